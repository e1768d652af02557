"""The storage node's network side: answers chunk requests, heartbeats the metadata daemon.

``StorageService.handle`` is the ``serve()`` handler (common/transport.py) for
the node's ROUTER socket. It checks each request's payload frames, then runs
the ChunkStore call in a worker thread (``trio.to_thread.run_sync`` under a
``CapacityLimiter`` of ``io_threads``), so that disk I/O and checksumming
never block the event loop of a busy node. Payload checksums (xxh3 of the
frame) are checked and computed in the same worker call. A cancelled request
lets its worker finish: a chunk write is never abandoned halfway.

Small requests never reach the event loop: the ROUTER socket belongs to a fast
lane thread (common/fast_lane.py) where ``handle_now`` answers

* a read of a chunk holding at most ``INLINE_READ_MAX`` bytes, from the page
  cache (``RWF_NOWAIT``) or, when no other request waits or runs, from the disk
  (a reader walking small files one at a time: nobody waits behind it);
* a write whose chunk stays within ``INLINE_WRITE_MAX`` bytes (page-cache
  writes: below direct_io's threshold), when no other thread holds the chunk's
  lock; one that asks for ``sync`` only when no other request waits;
* a delete of at most ``INLINE_BATCH_MAX`` chunks none of which a thread is
  writing, a stat, and a sync of at most that many chunks when no other request
  waits.

Anything else goes on to ``serve()``, which runs it in a worker thread. Under
trio a write cost the node about as much CPU again as the write itself (a task,
a limiter, a thread hand-off each way, a wake-up of the loop; docs/design.md,
"The storage node's write path"). The lane checks what ``handle`` checks
(``_check``: the request type, access, payload frames) and answers errors the
same way (an ErrorRsp with the StripefsError's code; a bad request is logged).
Everything it runs is bounded (a chunk of ``INLINE_WRITE_MAX``, a batch of
``INLINE_BATCH_MAX``) and never waits for another thread, so ``serve()``'s
request timeout has nothing to cut short there; its admission limits are not
needed for one request at a time, and the per-peer reply limit is the lane's
(``ReplyQueues``). The client sees no new reordering: ``serve()`` too runs a
peer's concurrent requests in any order. Node CPU per warm small read on each
of the read paths: bench/README.md, "Transport measurements".

Beside the server runs one heartbeat task per metadata daemon address::

    RegisterNodeReq   at start, until the daemon answers (it may start later)
    NodeHeartbeatReq  every heartbeat_interval_s, with capacity and usage
    RegisterNodeReq   again when the daemon answers NOT_FOUND (it restarted
                      and forgot us) or answers again after being unreachable

The node keeps serving clients whatever the daemon's state: an unreachable
daemon is logged once as a WARNING, and its return as INFO.
"""

from __future__ import annotations

import errno
import functools
import logging
import secrets
from typing import Any, Awaitable, Callable

import msgspec
import trio
import xxhash
import zmq

from ..common import protocol as p
from ..common import capability
from ..common.config import StorageConfig
from ..common.errors import ErrorCode, StripefsError
from ..common.keyring import server_keyring
from ..common.security import identity_of, with_key
from ..common.zap import run_zap
from ..common.fast_lane import serve_with_fast_lane
from ..common.transport import connect

from . import access, metrics
from .chunk_store import ChunkStore
from .healing import Healing

log = logging.getLogger(__name__)

#: reads of chunks holding up to this much are tried on the event loop before a worker thread (_read_inline)
INLINE_READ_MAX = 1 << 20
#: writes whose chunk (payload, merged old bytes) stays within this are done on the fast lane (handle_now)
INLINE_WRITE_MAX = 512 << 10
#: deletes and syncs of at most this many chunks are done on the fast lane
INLINE_BATCH_MAX = 64

_xxh3 = xxhash.xxh3_64_intdigest


class StorageService:
    """One storage node: the ChunkStore behind a ROUTER socket, plus heartbeats."""

    def __init__(self, config: StorageConfig, store: ChunkStore, *, ctx: zmq.Context | None = None):
        self.config = config
        self.store = store
        self.node_id = config.node_id
        self.boot_id = secrets.token_hex(8)  # changes on every process start
        self._ctx = ctx or zmq.Context.instance()
        self._limiter = trio.CapacityLimiter(config.io_threads)
        self._inline_reads = True  # off if the file system cannot do RWF_NOWAIT
        self._busy = 0  # requests being handled right now (1 = only the caller)
        self._handlers: dict[type, Callable[[Any, list[memoryview]], Awaitable[Any]]] = {
            p.PingReq: self.handle_ping,
            p.ReadChunkReq: self.handle_read_chunk,
            p.ReadChunksReq: self.handle_read_chunks,
            p.WriteChunkReq: self.handle_write_chunk,
            p.WriteChunksReq: self.handle_write_chunks,
            p.DeleteChunksReq: self.handle_delete_chunks,
            p.SyncChunksReq: self.handle_sync_chunks,
            p.StatChunkReq: self.handle_stat_chunk,
            p.NodeStatsReq: self.handle_node_stats,
        }
        self.healing = Healing(config, store, self._ctx, self._io)  # peer copies, scrub, bad copies (healing.py)
        self._handlers.update(self.healing.handlers())
        #: what handle_now does on the lane thread besides small reads: (request, its payload, waiting) -> reply or None
        self._now: dict[type, Callable[[Any, memoryview | None, bool], Any]] = {
            p.WriteChunkReq: self._write_now,
            p.DeleteChunksReq: self._delete_now,
            p.SyncChunksReq: self._sync_now,
            p.StatChunkReq: self._stat_now,
        }
        self.keyring = None  # with CURVE: the keys allowed in (storage_node/access.py)
        self.caps = None  # with cap_secret: checks subtree keys' capabilities (common/capability.py)

    # -- requests -------------------------------------------------------------

    async def handle(self, body: p.Msg, payloads: list[memoryview]):
        handler = self._check(body, payloads)
        self._busy += 1
        try:
            return await handler(body, payloads)
        except StripefsError as exc:
            self._refused(body, exc)
            raise
        finally:
            self._busy -= 1

    def _check(self, body: p.Msg, payloads: list[memoryview]):
        """The handler of a request this sender may send with these payload frames; else the
        StripefsError to answer (UNKNOWN_MESSAGE, ACCESS, READ_ONLY, BAD_REQUEST), logged."""
        handler = self._handlers.get(type(body))
        if handler is None:
            log.warning("node %d: %s is not a storage node request", self.node_id, type(body).__name__)
            raise StripefsError(ErrorCode.UNKNOWN_MESSAGE, f"a storage node does not handle {type(body).__name__}")
        access.check(self.keyring, body, self.node_id, self.caps)
        expected = _payload_frames(body)  # ReadChunksReq: none
        if len(payloads) != expected:
            log.warning("node %d: refusing %s with %d payload frames", self.node_id, type(body).__name__, len(payloads))
            raise StripefsError(
                ErrorCode.BAD_REQUEST, f"{type(body).__name__} takes {expected} payload frames, got {len(payloads)}"
            )
        return handler

    def _refused(self, body: p.Msg, exc: StripefsError) -> None:
        if exc.code == ErrorCode.BAD_REQUEST:  # bad input always leaves a log line
            log.warning("node %d: refusing %s: %s", self.node_id, type(body).__name__, exc.message)

    def handle_now(self, body: p.Msg, payloads: list[memoryview], *, waiting: bool = False):
        """The fast lane's handler (common/fast_lane.py, on its thread; ``waiting``: more requests are
        queued on the socket): a small read, write, delete, stat or sync answered at once, its
        error answered as ``serve()`` would (an ErrorRsp); None: ``serve()`` runs it in a worker
        thread (a large chunk, a lock held by another thread, a sync while others wait)."""
        now = self._now.get(type(body))
        if now is not None:
            try:
                self._check(body, payloads)  # logs its refusals itself
            except StripefsError as exc:
                return p.ErrorRsp(code=int(exc.code), message=exc.message)
            try:
                return now(body, payloads[0] if payloads else None, waiting)
            except BlockingIOError:
                return None  # it would wait: a worker thread does it
            except StripefsError as exc:
                self._refused(body, exc)
                return p.ErrorRsp(code=int(exc.code), message=exc.message)
        if type(body) is not p.ReadChunkReq or payloads:
            return None
        try:
            access.check(self.keyring, body, self.node_id, self.caps)
            result = self._read_inline(body, alone=not waiting, others=0)
        except StripefsError:
            return None  # the usual path answers it, and reports a corrupt copy
        if result is None:
            return None
        version, data, digest = result
        return p.ReadChunkRsp(version=version, xxh3=digest), [data]

    async def _io(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self._limiter)

    async def handle_ping(self, req: p.PingReq, payloads: list[memoryview]) -> p.PingRsp:
        return p.PingRsp(role="storage", node_id=self.node_id, boot_id=self.boot_id)

    async def handle_read_chunk(self, req: p.ReadChunkReq, payloads: list[memoryview]):
        try:
            result = self._read_inline(req)
            version, data, digest = result if result is not None else await self._io(self._read_and_hash, req)
        except StripefsError as exc:
            if exc.code == ErrorCode.CORRUPT:
                self.healing.note_bad(req.chunk)  # reported to the daemon, which repairs it
            raise
        return p.ReadChunkRsp(version=version, xxh3=digest), [data]

    async def handle_read_chunks(self, req: p.ReadChunksReq, payloads: list[memoryview]):
        # from the page cache on the event loop, until one needs the disk (None): then that one and the
        # rest go to a worker thread in one hop. A prefetcher's batch is cold or warm as a whole, and each
        # failed try costs an open (a cold inode: a disk read on the event loop), a header read and a close
        done: list[tuple[p.ChunkRead, bytes] | None] = [None] * len(req.reads)
        inline = functools.partial(self._read_inline, alone=False)
        for i, read in enumerate(req.reads):
            done[i] = _outcome(inline, read)
            if done[i] is None:
                break
        rest = [i for i, d in enumerate(done) if d is None]
        if rest:  # the others in one worker-thread hop

            def read_rest():
                for i in rest:
                    done[i] = _outcome(self._read_and_hash, req.reads[i])

            await self._io(read_rest)
        for read, (result, _) in zip(req.reads, done):
            if result.code == ErrorCode.CORRUPT:
                self.healing.note_bad(read.chunk)  # as for a single read (on the loop, not in the thread)
        return p.ReadChunksRsp(results=[d[0] for d in done]), [d[1] for d in done]

    def _read_inline(self, req: p.ReadChunkReq, *, alone: bool = True, others: int = 1) -> tuple[int, bytes, int] | None:
        """A read of at most INLINE_READ_MAX stored bytes on the event loop, when that delays nobody:
        from the page cache, or from the disk too if ``alone`` and no other request is being handled
        (``others``: how many of ``_busy`` are the caller's own: 1 in handle(), 0 on the fast path).
        None: it goes to a worker thread (a larger chunk, or the disk while others wait)."""
        from_disk = alone and self._busy <= others
        if not (from_disk or self._inline_reads):
            return None
        try:
            return self._read_and_hash(req, nowait=not from_disk, max_bytes=INLINE_READ_MAX)
        except BlockingIOError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._inline_reads = False
                log.info("node %d: the data file system cannot read without waiting (%s); reads go to threads", self.node_id, exc.strerror)
            return None

    def _read_and_hash(self, req: p.ReadChunkReq, nowait: bool = False, max_bytes: int | None = None) -> tuple[int, bytes, int]:
        version, data = self.store.read(req.chunk, req.min_version, req.offset, req.length, nowait=nowait, max_bytes=max_bytes)
        return version, data, _xxh3(data)

    async def handle_write_chunk(self, req: p.WriteChunkReq, payloads: list[memoryview]) -> p.WriteChunkRsp:
        meta = await self._io(self._check_and_write, req, payloads[0])
        return p.WriteChunkRsp(version=meta.version, length=meta.length)

    def _write_now(self, req: p.WriteChunkReq, data: memoryview, waiting: bool) -> p.WriteChunkRsp | None:
        if (req.sync and waiting) or len(data) > INLINE_WRITE_MAX:
            return None
        meta = self._check_and_write(req, data, max_bytes=INLINE_WRITE_MAX, wait=False)
        return p.WriteChunkRsp(version=meta.version, length=meta.length)

    def _check_and_write(self, req: p.WriteChunkReq, data: memoryview, **now: Any):
        """Check the payload's checksum and write it (``now``: the fast lane's ``max_bytes`` and
        ``wait=False``, ChunkStore.write)."""
        digest = _xxh3(data)
        if digest != req.xxh3:  # damaged in flight, or a client bug: write nothing
            raise StripefsError(
                ErrorCode.BAD_REQUEST, f"payload for chunk {req.chunk} has xxh3 {digest:x}, the header says {req.xxh3:x}"
            )
        return self.store.write(
            req.chunk,
            req.version,
            req.base_version,
            req.offset,
            data,
            replace=req.replace,
            truncate=req.truncate,
            sync=req.sync,
            **now,
        )

    async def handle_write_chunks(self, req: p.WriteChunksReq, payloads: list[memoryview]) -> p.WriteChunksRsp:
        total = sum(len(d) for d in payloads)
        if total > p.MAX_BATCH_WRITE_BYTES:
            raise StripefsError(ErrorCode.BAD_REQUEST, f"{total} payload bytes in one batch; at most {p.MAX_BATCH_WRITE_BYTES}")
        return p.WriteChunksRsp(results=await self._io(self._write_batch, req, payloads))

    def _write_batch(self, req: p.WriteChunksReq, payloads: list[memoryview]) -> list[p.ChunkWritten]:
        """Each write on its own (its error is its own answer), then one sync for those written."""
        results: list[p.ChunkWritten] = []
        for item, data in zip(req.writes, payloads):
            try:
                meta = self._check_and_write(msgspec.structs.replace(item, sync=False), data)
            except StripefsError as exc:
                if exc.code == ErrorCode.BAD_REQUEST:
                    log.warning("node %d: refusing the write of chunk %s in a batch: %s", self.node_id, item.chunk, exc.message)
                results.append(p.ChunkWritten(version=0, length=0, code=int(exc.code), message=exc.message))
            else:
                results.append(p.ChunkWritten(version=meta.version, length=meta.length))
        written = [item.chunk for item, r in zip(req.writes, results) if not r.code]
        if written and (req.sync or any(item.sync for item in req.writes)):
            try:
                self.store.sync_batch(written)
            except StripefsError as exc:  # nothing written here is known durable: none of it succeeded
                results = [r if r.code else p.ChunkWritten(version=0, length=0, code=int(exc.code), message=exc.message) for r in results]
        return results

    async def handle_delete_chunks(self, req: p.DeleteChunksReq, payloads: list[memoryview]) -> p.DeleteChunksRsp:
        _check_delete(req)
        return await self._io(self._delete, req)

    def _delete_now(self, req: p.DeleteChunksReq, data: None, waiting: bool) -> p.DeleteChunksRsp | None:
        _check_delete(req)
        if len(req.chunks) > INLINE_BATCH_MAX or self.store.busy(req.chunks):
            return None  # long, or it would wait for a write of one of them
        return self._delete(req)

    def _delete(self, req: p.DeleteChunksReq) -> p.DeleteChunksRsp:
        deleted = self.store.delete(req.chunks, req.all_parts, req.max_versions)
        log.info("node %d: deleted %d chunk files for %d chunk ids", self.node_id, deleted, len(req.chunks))
        return p.DeleteChunksRsp(deleted=deleted)

    async def handle_sync_chunks(self, req: p.SyncChunksReq, payloads: list[memoryview]) -> p.OkRsp:
        await self._io(self.store.sync, req.chunks)
        return p.OkRsp()

    def _sync_now(self, req: p.SyncChunksReq, data: None, waiting: bool) -> p.OkRsp | None:
        if waiting or len(req.chunks) > INLINE_BATCH_MAX:
            return None  # fsyncs take the disk's time: not while others wait behind them
        self.store.sync(req.chunks)
        return p.OkRsp()

    async def handle_stat_chunk(self, req: p.StatChunkReq, payloads: list[memoryview]) -> p.StatChunkRsp:
        return await self._io(self._stat_now, req, None, False)

    def _stat_now(self, req: p.StatChunkReq, data: None, waiting: bool) -> p.StatChunkRsp:
        meta = self.store.stat(req.chunk)
        return p.StatChunkRsp(version=meta.version, length=meta.length)

    async def handle_node_stats(self, req: p.NodeStatsReq, payloads: list[memoryview]) -> p.NodeStatsRsp:
        usage = await self._io(self.store.usage)
        metrics.set_store_usage(usage)
        return p.NodeStatsRsp(node_id=self.node_id, **usage._asdict())

    # -- running --------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report started, then serve and heartbeat until cancelled."""
        self.keyring = server_keyring(self._ctx, self.config.curve_key, self.config.keyring, [self.config.listen])
        self.caps = capability.load(self.config.cap_secret)
        async with trio.open_nursery() as zap:
            if self.keyring is not None:  # ZAP must answer before the first client connects
                await zap.start(run_zap, self._ctx, self.keyring.accepts)
            try:
                await self._serve(task_status)
            finally:
                zap.cancel_scope.cancel()

    async def _serve(self, task_status) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(
                    serve_with_fast_lane, self._ctx, self.config.listen, self.handle, self.handle_now,
                    name=f"storage-{self.node_id}", limits=self.config.serve_limits(),
                ),
                name=f"storage-{self.node_id}-server",
            )
            await nursery.start(self.healing.run, name=f"storage-{self.node_id}-healing")
            for address in self.config.meta:
                nursery.start_soon(self._heartbeat_loop, address, name=f"storage-{self.node_id}-heartbeat-{address}")
            task_status.started()

    @property
    def address(self) -> str:
        """Where clients and peers reach this node, with its public key when CURVE is on."""
        identity = identity_of(self._ctx)
        return with_key(self.config.address, identity.public if identity and self.keyring is not None else None)

    async def _heartbeat_loop(self, address: str) -> None:
        interval = self.config.heartbeat_interval_s
        async with connect(self._ctx, address, timeout=max(2 * interval, 0.5)) as meta:
            registered = False
            trouble = ""  # what went wrong last time; "" while the daemon answers
            while True:
                try:
                    registered = await self._beat(meta, registered)
                except OSError as exc:  # statvfs of data_dir failed: the disk is in trouble
                    log.error("node %d: cannot read disk usage of %s: %s", self.node_id, self.config.data_dir, exc)
                except StripefsError as exc:
                    if exc.code == ErrorCode.NOT_FOUND and registered:
                        log.info("node %d: metadata daemon %s does not know this node; registering again", self.node_id, address)
                        registered = False
                        continue
                    registered = False  # whatever the daemon lost meanwhile, announce ourselves afresh
                    unreachable = exc.code in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE)
                    problem = "is unreachable" if unreachable else f"refused us ({getattr(exc.code, 'name', exc.code)})"
                    if problem != trouble:  # once per change, not on every beat
                        log.warning("node %d: metadata daemon %s %s: %s", self.node_id, address, problem, exc.message)
                        trouble = problem
                else:
                    if trouble:
                        log.info("node %d: metadata daemon %s answers again", self.node_id, address)
                        trouble = ""
                await trio.sleep(interval)

    async def _beat(self, meta, registered: bool) -> bool:
        """One RegisterNodeReq (when not registered) or NodeHeartbeatReq; returns True."""
        usage = await self._io(self.store.usage)
        metrics.set_store_usage(usage)
        if registered:
            await meta.call(p.NodeHeartbeatReq(node_id=self.node_id, **usage._asdict()))
            await self.healing.send_reports(meta)
            return True
        await meta.call(
            p.RegisterNodeReq(
                node_id=self.node_id,
                address=self.address,
                host=self.config.host_label,
                **usage._asdict(),
            )
        )
        log.info(
            "node %d: registered with metadata daemon %s as %s (host %s, %d chunks, %d bytes free)",
            self.node_id,
            meta.address,
            self.address,
            self.config.host_label,
            usage.chunks,
            usage.free_bytes,
        )
        return True


def _payload_frames(body: p.Msg) -> int:
    """How many payload frames a request must carry: one per chunk write."""
    if type(body) is p.WriteChunkReq:
        return 1
    if type(body) is p.WriteChunksReq:
        return len(body.writes)
    return 0


def _check_delete(req: p.DeleteChunksReq) -> None:
    if req.max_versions and len(req.max_versions) != len(req.chunks):
        raise StripefsError(ErrorCode.BAD_REQUEST, f"{len(req.max_versions)} max_versions for {len(req.chunks)} chunks")


def _outcome(read, request: p.ReadChunkReq) -> tuple[p.ChunkRead, bytes] | None:
    """One read of a ReadChunksReq: its result and payload (an empty one when it failed); None when
    ``read`` (the inline one) leaves it to a worker thread."""
    try:
        done = read(request)
    except StripefsError as exc:
        return p.ChunkRead(version=0, xxh3=0, code=int(exc.code), message=exc.message), b""
    if done is None:
        return None
    version, data, digest = done
    return p.ChunkRead(version=version, xxh3=digest), data
