"""The data path: file byte ranges <-> chunks on storage nodes.

Reads
    A read is split into per-chunk extents (common.layout.chunk_extents). Each
    chunk is fetched whole from one replica (tried in rotated order, suspects
    last, failing over on timeout, STALE, CORRUPT or a missing copy) into the
    chunk cache, so the kernel's 1 MiB requests within one chunk cost one
    network read. A replica that has not answered within ``hedge_after_s`` is
    joined by the next one (a hedged read); the first good answer wins. A
    sequential reader keeps a window of chunks fetched ahead of it, growing up
    to ``readahead_chunks`` (client/readahead.py); chunks of one read are
    fetched in parallel.
    A chunk never written (no placement, or version 0) reads as zeros.

Writes
    Buffered per chunk (open_files.DirtyChunk) and sent to every replica in
    parallel, carrying this write session's epoch as the chunk version, or
    another epoch of the other parity when the session's has the committed
    version's: a new version goes to the other slot (common/layout.py
    "Slots"), copy-on-write, so a session that fails or whose writer dies
    leaves the committed copy on every replica as it was. A
    replica that answers STALE gets the whole chunk (``replace``); a replica
    whose node fails is moved to another node by the metadata daemon
    (ReplaceReplicaReq) and receives the whole chunk, read back from a replica
    that took the write. So one node dying mid-write costs the writer nothing.
    The chunk map may be older than the chunk's placement (the daemon moves
    copies of open files: repair, drain): when no replica it names takes a
    range of a chunk the session has not written yet, or one answers STALE,
    the daemon is asked where the chunk is now and the range goes there, once;
    the cut of a truncate does the same (client/placements.py has the rule and
    why it stops at chunks the session wrote).
    ``flush`` waits for everything in flight and commits versions and size.
    Sends of one chunk are applied in order (``OpenFile.take``); a send that
    fails fails the whole write session, which is then discarded, never
    committed, and reported by the next flush/fsync (open_files.py).
    A file growing chunk by chunk gets placements ahead, up to ``ALLOC_AHEAD``
    chunks per AllocChunksReq (``alloc_indices``): one daemon round trip per
    64 MiB written instead of one per chunk.
    Directory quotas (daemon/quota.py): a write that would grow the file past
    ``OpenFile.quota_max`` asks the daemon again (QuotaRoomReq), then takes the
    part that fits (a short write) or raises QUOTA_EXCEEDED (EDQUOT); a commit
    the daemon cut to the limit makes ``flush`` cut the boundary chunk on its
    replicas and raise QUOTA_EXCEEDED, so nothing past the limit is kept.

Erasure-coded files (layout ``ec=K+M``) share the dirty buffering, epochs and
commits, and take client/ec_path.py at five points: reads, the sending of a
dirty chunk, the cut of a truncate, fsync and the prefetch of small files.

Fetches ahead of reads (read-ahead, a walked directory's small files and read
hints, the sampler-order prefetcher) all start through ``fetch``
(client/fetch.py says what each one is).

Memory: the chunk cache has its byte budget; unsent data is at most
``MAX_DIRTY_CHUNKS`` partial chunks per file being written, and chunks being
sent at most ``write_parallelism`` per file and ``write_inflight`` for the
mount, so the client's memory stays within ``cache_size`` plus a few dozen
chunks however applications write.

Atomicity: an ``OpenFile``'s dirty map is only changed between awaits; a chunk
is removed from ``dirty`` before its send starts, so no byte is sent twice or lost.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, NamedTuple

import trio
import xxhash

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import chunk_extents, is_ec, replica_part
from .chunk_cache import ChunkCache
from .data_rpc import NodePool
from .disk_cache import DiskCache
from .ec_path import EcPath
from .fetch import Fetch
from .meta_rpc import MetaClient
from .open_files import DirtyChunk, OpenFile
from . import placements
from .placements import ALLOC_AHEAD, alloc_indices, fresh_epoch, is_cold, moved, placement, recall, session_epoch, slot_version  # noqa: F401  (ALLOC_AHEAD, alloc_indices: also here for tests)
from .readahead import ReadStream

log = logging.getLogger(__name__)


#: partial chunks a file may hold unsent; a writer scattering more sends its oldest first
MAX_DIRTY_CHUNKS = 8

_FAILOVER = {ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE, ErrorCode.STALE, ErrorCode.CORRUPT, ErrorCode.NOT_FOUND, ErrorCode.IO}


class Handed(NamedTuple):
    """A write session handed to its CommitReq (``DataPath.commit_request``), until the answer."""

    refs: list[p.ChunkRef]  # the chunk versions it commits
    before: dict[int, p.ChunkRef | None]  # OpenFile.before_session
    wanted: int  # the size it asks for (OpenFile.written_end)
    mtime_ns: int  # its last write's time (0: the commit's)
    answered: trio.Event  # set at the answer or failure (OpenFile.commit_sent)


class DataPath:
    def __init__(
        self,
        meta: MetaClient,
        nodes: NodePool,
        cache: ChunkCache,
        nursery: trio.Nursery,
        *,
        readahead_chunks: int,
        write_parallelism: int,
        write_inflight: int = 16,
    ):
        self.meta = meta
        self.nodes = nodes
        self.cache = cache
        self.nursery = nursery
        self.readahead_chunks = readahead_chunks
        self.write_parallelism = write_parallelism
        self.disk_cache: DiskCache | None = None  # set by the mount when configured
        # chunks being written in the background, all files together (memory bound, with MAX_DIRTY_CHUNKS)
        self.write_slots = trio.Semaphore(max(write_parallelism, write_inflight))
        self.ec = EcPath(meta, nodes, cache, nursery)  # erasure-coded files (client/ec_path.py)
        #: a LOOKUP's or a read hint's fetch taken by the plain-thread reads (client/thread_reads.py
        #: ThreadReads.fetch_soon: True if taken); None: every fetch in trio
        self.thread_fetch: Callable[[Fetch], bool] | None = None
        #: called with the inode of a discarded write session: the kernel's pages and size are wrong now
        self.on_discard: Callable[[int], None] = lambda ino: None
        #: called with the inode of a commit (a flush's, an fsync's, a truncate's): what was known of it is old
        self.on_commit: Callable[[int, p.Msg], None] = lambda ino, rsp: None  # (the inode, the commit's or truncate's AttrRsp)

    # ------------------------------------------------------------------ reads

    async def read(self, of: OpenFile, offset: int, length: int, stream: ReadStream | None = None) -> bytes | memoryview:
        """Bytes [offset, offset+length) of the file; ``stream``: the handle's read-ahead state."""
        end = min(offset + length, of.size)
        if end <= offset:
            return b""
        extents = list(chunk_extents(offset, end - offset, of.chunk_size))
        if of.dirty or of.inflight or of.write_error:
            # our own bytes not yet on storage: send them (uncommitted versions are readable)
            for ext in extents:
                if ext.index in of.dirty and of.write_error is None:
                    try:
                        await self._send(of, of.take(ext.index))
                    except StripefsError:
                        pass  # the session failed: it is discarded below, the read sees what is committed
            await self._settle(of)
            end = min(offset + length, of.size)
            if end <= offset:
                return b""
            extents = list(chunk_extents(offset, end - offset, of.chunk_size))
        ahead = stream.advance(offset, end, of.chunk_size, self.readahead_chunks) if stream is not None else 0
        cold = [ext.index for ext in extents if is_cold(of.chunks.get(ext.index))]
        if cold:  # in a tier (docs/tiering.md): the daemon brings them back first, with the read-ahead window's
            window = range(extents[-1].index + 1, min(extents[-1].index + 1 + ahead, -(-of.size // of.chunk_size)))
            await recall(self.meta, self.nodes, of, cold + [i for i in window if is_cold(of.chunks.get(i))])
        if is_ec(of.layout):
            return await self.ec.read(of, extents, ahead)
        if len(extents) == 1:
            ext = extents[0]
            out = _piece(await self._chunk_bytes(of, ext.index), ext.offset, ext.length)
        else:
            parts: list[bytes | memoryview] = [b""] * len(extents)

            async def fetch(i, ext):
                parts[i] = _piece(await self._chunk_bytes(of, ext.index), ext.offset, ext.length)

            async with trio.open_nursery() as nursery:
                for i, ext in enumerate(extents):
                    nursery.start_soon(fetch, i, ext)
            out = b"".join(parts)
        if ahead:
            ahead = min(ahead, max(1, self.cache.budget // 4 // of.chunk_size))
            last = extents[-1].index
            for index in range(last + 1, last + 1 + ahead):
                if index * of.chunk_size >= of.size:
                    break
                self.fetch_soon(Fetch.ahead_of(of, index))
        return out

    async def _chunk_bytes(self, of: OpenFile, index: int) -> bytes | memoryview:
        ref = of.chunks.get(index)
        if ref is None or ref.version == 0:
            return b""
        disk = index not in of.uncommitted  # (_read_chunk: a version of this mount's open session is never on disk)
        return await self.cache.fetch((of.ino, index, ref.version),
                                      lambda: self._read_chunk(of.ino, ref, of.chunk_size, disk=disk))

    # ---------------------------------------------------------------- fetches

    def fetch_soon(self, want: Fetch) -> None:
        """``fetch([want])`` in the background, unless its chunk is cached or being loaded already."""
        key = want.key
        if key is None or key in self.cache:
            return
        if want.info is not None:
            if is_ec(want.info.layout):
                return self.ec.prefetch_small_file(want.info)
            self.nodes.learn(want.info.nodes)
        if self.thread_fetch is not None and self.disk_cache is None and self.thread_fetch(want):
            return  # loaded on a plain thread, where its READ is answered (client/thread_reads.py)
        self.nursery.start_soon(self.fetch, [want], name=f"fetch-{want.ino}-{want.index}")

    async def fetch(self, wants: list[Fetch], *, node: int | None = None) -> list[bytes | memoryview | StripefsError]:
        """Bring chunks into the chunk cache ahead of their reads: every fetch starts here (client/fetch.py).

        Each is its bytes or why it failed (logged at debug: the read that follows retries and reports).
        ``node``: whole one-chunk replicated files, all from that node in one request (the prefetcher's
        batches), stored in the cache as they come; else one load of the cache each, shared with any
        read of the same chunk (ChunkCache.fetch)."""
        if node is not None:
            return await self._fetch_from(node, wants)
        out: list[bytes | memoryview | StripefsError] = []
        for want in wants:
            ref = want.current_ref()
            if ref is None:
                out.append(b"")
                continue
            if want.exact:
                load = functools.partial(self._read_exact, want.ino, ref, want.length)
            else:
                disk = want.of is None or want.index not in want.of.uncommitted
                load = functools.partial(self._read_chunk, want.ino, ref, want.length, quiet=True, disk=disk)
            try:
                out.append(await self.cache.fetch((want.ino, want.index, ref.version), load, prefetch=want.ahead))
            except StripefsError as exc:
                # the file may have been changed, truncated or deleted meanwhile; a real read will say so
                log.debug("fetch of chunk %d:%d failed: %s", want.ino, want.index, exc)
                out.append(exc)
        return out

    async def _fetch_from(self, node: int, wants: list[Fetch]) -> list[bytes | memoryview | StripefsError]:
        reads = [p.ReadChunkReq(chunk=p.ChunkId(p.data_ino(w.ino, w.ref), 0, replica_part(w.ref.version)), min_version=w.ref.version, offset=0, length=w.length) for w in wants]
        keys = [(w.ino, 0, w.ref.version) for w in wants]
        claimed = set(self.cache.claim(keys))
        results: list = [None] * len(wants)
        try:
            results = await self.nodes.read_many(node, reads)
        except StripefsError as exc:
            log.debug("fetch of %d chunks from node %d failed: %s", len(wants), node, exc)
            results = [exc] * len(wants)
        finally:
            for key, result in zip(keys, results):
                data = None if result is None or isinstance(result, StripefsError) else result
                if key in claimed:
                    self.cache.settle(key, data)
                elif data is not None:
                    self.cache.put(key, data)
        return results

    async def _read_exact(self, ino: int, ref: p.ChunkRef, length: int) -> memoryview:
        """Chunk 0 of a hinted file from the replica a read would ask first, only at exactly the hinted
        version (a newer copy is not what the key says); one try, no fail-over: it is a guess."""
        key = (ino, 0, ref.version)
        if self.disk_cache is not None:
            data = await self.disk_cache.get(key)
            if data is not None:
                return data
        node_id = self.nodes.order(ref.nodes, start=ino)[0]
        chunk = p.ChunkId(p.data_ino(ino, ref), 0, replica_part(ref.version))
        version, data = await self.nodes.read_versioned(node_id, chunk, ref.version, 0, length, last_try=False)
        if version != ref.version:
            raise StripefsError(ErrorCode.STALE, f"inode {ino} is at version {version}, the hint said {ref.version}")
        if self.disk_cache is not None:
            self.disk_cache.put_soon(self.nursery, key, data)
        return data

    #: a replica that has not answered this long is joined by the next one (ClientConfig.hedge_after_s; 0: never)
    hedge_after_s = 0.5

    async def _hedged_read(self, chunk: p.ChunkId, version: int, length: int, order: list[int], errors: list[str]) -> memoryview | None:
        """Ask ``order[0]``; when it has not answered within ``hedge_after_s`` (or failed), ask the next
        too; the first good answer wins and the others are cancelled. None when every copy failed
        (their errors appended to ``errors``); an error that is no reason to fail over is raised."""
        results_send, results = trio.open_memory_channel(len(order))
        launched = pending = 0
        fatal: StripefsError | None = None
        answered: set[int] = set()

        async def attempt(node_id: int, last: bool) -> None:
            try:
                data = await self.nodes.read(node_id, chunk, version, 0, length, last_try=last)
            except StripefsError as exc:
                results_send.send_nowait((node_id, None, exc))
            else:
                results_send.send_nowait((node_id, data, None))

        async with trio.open_nursery() as nursery:

            def launch() -> None:
                nonlocal launched, pending
                nursery.start_soon(attempt, order[launched], launched == len(order) - 1)
                launched += 1
                pending += 1

            launch()
            while pending:
                hedge = self.hedge_after_s if launched < len(order) else float("inf")
                with trio.move_on_after(hedge) as waited:
                    node_id, data, exc = await results.receive()
                if waited.cancelled_caught:
                    log.debug("chunk %s: node %d is slow; asking node %d too", chunk, order[launched - 1], order[launched])
                    launch()
                    continue
                pending -= 1
                answered.add(node_id)
                if exc is None:
                    nursery.cancel_scope.cancel()
                    for slow in order[:launched]:
                        if slow not in answered:  # beaten by a hedge: asked last for a while
                            self.nodes.note_slow(slow)
                    return data
                if exc.code not in _FAILOVER:
                    fatal = exc  # raised outside the nursery: callers expect a plain StripefsError
                    nursery.cancel_scope.cancel()
                    break
                errors.append(f"node {node_id}: {exc}")
                log.log(
                    logging.WARNING if exc.code == ErrorCode.CORRUPT else logging.INFO,
                    "chunk %s v%d: node %d failed (%s); trying the next copy", chunk, version, node_id, exc,
                )
                if launched < len(order):
                    launch()
        if fatal is not None:
            raise fatal
        return None

    async def _read_chunk(self, ino: int, ref: p.ChunkRef, length: int, *, quiet: bool = False,
                          disk: bool = True) -> memoryview:
        """Read a whole chunk: the disk cache, else the network (and fill the disk cache).

        ``disk`` False: a chunk this mount's write session sent and has not committed. Its version
        is the session's epoch, and every later send of the chunk in the same session stores other
        bytes under that same version (the memory cache drops its copy at each send); the disk
        cache, keyed by version and kept across remounts and between mounts sharing the directory,
        would keep the bytes of the read and serve them for the committed version (found by
        tests/datapath_model.py with disk_cache_dir on every mount: zeros past an mmap write)."""
        key = (ino, ref.index, ref.version)
        disk_cache = self.disk_cache if disk else None
        if disk_cache is not None:
            data = await disk_cache.get(key)
            if data is not None:
                return data
        data = await self._read_chunk_from_nodes(ino, ref, length, quiet=quiet)
        if disk_cache is not None:
            disk_cache.put_soon(self.nursery, key, data)
        return data

    async def _read_chunk_from_nodes(
        self, ino: int, ref: p.ChunkRef, length: int, *, quiet: bool = False, refreshed: bool = False
    ) -> memoryview:
        """Read a whole chunk from the first replica that has it. ``quiet``: a prefetch, whose failure is no error.

        When no copy named by ``ref`` can be read, the chunk may have moved since the file was
        opened (repair, drain, rebalance: copy, switch, delete): ask the daemon where it is now
        and try once more there."""
        chunk = p.ChunkId(p.data_ino(ino, ref), ref.index, replica_part(ref.version))  # a snapshot may share the live copies
        order = self.nodes.order(ref.nodes, start=ino + ref.index)
        errors = []
        if self.hedge_after_s > 0 and len(order) > 1:
            data = await self._hedged_read(chunk, ref.version, length, order, errors)
            if data is not None:
                return data
            order = []  # every copy failed: fall through to the error below
        for i, node_id in enumerate(order):
            try:
                return await self.nodes.read(node_id, chunk, ref.version, 0, length, last_try=i == len(order) - 1)
            except StripefsError as exc:
                if exc.code not in _FAILOVER:
                    raise
                errors.append(f"node {node_id}: {exc}")
                log.log(
                    logging.WARNING if exc.code == ErrorCode.CORRUPT else logging.INFO,
                    "chunk %s v%d: node %d failed (%s); trying the next copy",
                    chunk,
                    ref.version,
                    node_id,
                    exc,
                )
        if not refreshed and self.meta is not None:
            moved = await self._where_now(ino, ref)
            if moved is not None:
                log.info("chunk %s: moved from nodes %s to %s since the file was opened", chunk, ref.nodes, moved.nodes)
                return await self._read_chunk_from_nodes(ino, moved, length, quiet=quiet, refreshed=True)
        log.log(logging.DEBUG if quiet else logging.ERROR, "chunk %s v%d: no copy could be read: %s", chunk, ref.version, "; ".join(errors))
        raise StripefsError(ErrorCode.IO, f"chunk {chunk}: no readable copy")

    async def _where_now(self, ino: int, ref: p.ChunkRef) -> p.ChunkRef | None:
        """The chunk's current placement when it differs from ``ref`` (read at ``ref``'s version)."""
        now = await placements.current(self.meta, self.nodes, ino, ref.index)
        recalled = False
        if is_cold(now) and now.version == ref.version:  # moved to a tier since: the daemon brings it back
            rsp = await self.meta.call(p.TierRecallReq(ino=ino, indices=[ref.index]))
            self.nodes.learn(rsp.nodes)
            now = next((c for c in rsp.chunks if c.index == ref.index), None)
            recalled = now is not None and bool(now.nodes)
        if now is None or (set(now.nodes) <= set(ref.nodes) and not recalled):
            return None
        return p.ChunkRef(index=ref.index, version=ref.version, nodes=now.nodes)

    # ----------------------------------------------------------------- writes

    async def write(self, of: OpenFile, offset: int, data: bytes) -> int:
        """Buffer (and send) a write; the bytes taken: fewer than ``len(data)`` only at a quota's limit.

        After a failed send of this write session every write is refused with that error
        until a flush or fsync has reported it (open_files.py)."""
        if of.write_error is not None:
            await self._settle(of)
            raise of.write_error
        if of.quota_max >= 0 and offset + len(data) > max(of.quota_max, of.size):
            data = await self._within_quota(of, offset, data)
        cs = of.chunk_size
        pos = 0
        for ext in chunk_extents(offset, len(data), cs):
            piece = memoryview(data)[pos : pos + ext.length]
            pos += ext.length
            dc = of.dirty.get(ext.index)
            while dc is not None and not dc.takes(ext.offset, ext.length):
                await self._send(of, of.take(ext.index))
                # the kernel's writeback of mmap'd pages sends WRITEs of one file at the same
                # time: another may have buffered a new range of this chunk meanwhile
                dc = of.dirty.get(ext.index)
            if dc is None:
                dc = DirtyChunk(ext.index, bytearray(), ext.offset, ext.offset)  # merge() makes its range
                of.dirty[ext.index] = dc
            dc.merge(ext.offset, piece)
            if dc.contiguous and dc.lo == 0 and dc.hi == cs:
                await self._send_in_background(of, of.take(ext.index))
            elif len(of.dirty) > MAX_DIRTY_CHUNKS:  # a scattered writer: memory stays bounded
                await self._send_in_background(of, of.take(next(iter(of.dirty))))
        of.size = max(of.size, offset + len(data))
        of.written_end = max(of.written_end, offset + len(data))
        # the chunk cache is left as it is: a buffered range is not on the nodes yet, a read of its
        # chunk sends it first, and the send drops the chunk (``_send``, EcPath), so the committed
        # version's entries stay for an EC write's parity delta and read-modify-write (write-through)
        return len(data)

    def adopt(self, of: OpenFile, data: bytearray) -> bool:
        """``write(of, 0, data)`` for a write that is the file's only buffered data and stays within its
        first chunk, ``data`` kept as that chunk's buffer instead of copied into a new one: the kept
        early write of a small file (``Operations._replay``), copied once already from the FUSE
        request; a second copy was ~6% of the mount's trio thread in a ``cp -r`` of 110 KiB files
        (docs/design.md, "What a copied file costs"). The caller gives ``data`` up. False: not such
        a write (an error to report, other data buffered, a quota to ask, a whole chunk: ``write``
        sends that at once), nothing done."""
        n = len(data)
        if of.write_error is not None or of.dirty or not 0 < n < of.chunk_size or (of.quota_max >= 0 and n > max(of.quota_max, of.size)):
            return False
        of.dirty[0] = DirtyChunk(0, data, 0, n)  # as merge() leaves a fresh chunk: one range [0, n)
        of.size = max(of.size, n)
        of.written_end = max(of.written_end, n)
        return True

    async def _within_quota(self, of: OpenFile, offset: int, data: bytes) -> bytes | memoryview:
        """The part of a write that fits under the file's directory quotas (asked afresh: others may have shrunk)."""
        rsp = await self.meta.call(p.QuotaRoomReq(ino=of.ino))
        of.quota_max = rsp.max_size
        limit = max(of.quota_max, of.size)
        if of.quota_max < 0 or offset + len(data) <= limit:
            return data
        if offset >= limit:
            raise StripefsError(
                ErrorCode.QUOTA_EXCEEDED, f"inode {of.ino}: a directory quota allows at most {limit} bytes here"
            )
        return memoryview(data)[: limit - offset]

    async def _send(self, of: OpenFile, dc: DirtyChunk, *, sync: bool = False) -> None:
        """Send a range taken with ``OpenFile.take``, after the chunk's earlier sends.

        Not stored (an error, or cancelled by the operation deadline): the write session
        has failed (``_fail``) and the error is raised."""
        try:
            if dc.after is not None:
                await dc.after.wait()
            if of.write_error is not None:
                raise of.write_error  # the session failed already: storing more of it is pointless
            await self._send_chunk(of, dc, sync=sync)
        except BaseException as exc:
            self._fail(of, exc)
            raise
        finally:
            of.sent(dc)

    def _fail(self, of: OpenFile, exc: BaseException) -> None:
        """A range of this write session could not be stored: the session is lost (open_files.py)."""
        if of.write_error is not None:
            return
        if isinstance(exc, StripefsError):
            error = exc
        elif isinstance(exc, trio.Cancelled):
            error = StripefsError(ErrorCode.TIMEOUT, "the write was not stored within the operation deadline")
        else:
            error = StripefsError(ErrorCode.IO, f"the write failed: {exc!r}")
        of.write_error = error
        log.error(
            "inode %d: data written since the last commit could not be stored (%s); it is discarded, "
            "the file keeps its committed content and the next close or fsync reports the error", of.ino, error,
        )
        self.on_discard(of.ino)

    async def _settle(self, of: OpenFile) -> None:
        """Wait for the sends in flight; a failed session is then thrown away (its error stays to be reported)."""
        await of.idle.wait()
        if of.write_error is not None and (of.dirty or of.uncommitted or of.before_session or of.size != of.attr.size):
            of.discard_session()
            self.cache.drop_inode(of.ino)
            self.ec.forget_unsynced(of.ino)
            self.on_discard(of.ino)

    async def _send_in_background(self, of: OpenFile, dc: DirtyChunk) -> None:
        try:
            if of.write_slots is None:
                of.write_slots = trio.Semaphore(self.write_parallelism)
            await of.write_slots.acquire()  # backpressure: at most N chunks in flight per file
            try:
                await self.write_slots.acquire()  # ... and at most M for the whole mount
            except BaseException:
                of.write_slots.release()
                raise
        except BaseException as exc:  # the deadline passed while waiting: this range is not stored
            self._fail(of, exc)
            of.sent(dc)
            raise

        async def send():
            try:
                await self._send(of, dc)
            except StripefsError:
                pass  # recorded in of.write_error by _send
            finally:
                self.write_slots.release()
                of.write_slots.release()

        self.nursery.start_soon(send, name=f"write-{of.ino}-{dc.index}")

    async def _epoch(self, of: OpenFile) -> int:
        return await session_epoch(self.meta, of)

    async def _placement(self, of: OpenFile, index: int) -> p.ChunkRef:
        return await placement(self.meta, self.nodes, of, index)

    async def _send_chunk(self, of: OpenFile, dc: DirtyChunk, *, sync: bool = False) -> None:
        """Write one dirty range to every replica of its chunk, replacing failed replicas."""
        if dc.index in of.placed_ahead:
            of.placed_ahead.discard(dc.index)  # used: inside the file from now on
        if dc.index not in of.uncommitted:
            await of.commit_settled(dc.index)  # the slot of its new version is known once a commit carrying it is answered
        if is_ec(of.layout):
            return await self.ec.send_stripe(of, dc, sync=sync)
        epoch = await self._epoch(of)
        ref = await self._placement(of, dc.index)
        mine = of.uncommitted.get(dc.index)
        # copy-on-write: a new version goes to the slot the committed one does not use (placements.slot_version)
        epoch = mine.version if mine is not None else await slot_version(self.meta, of, epoch, ref.version)
        chunk = p.ChunkId(of.ino, dc.index, replica_part(epoch))
        # A chunk with no committed data is a hole before this write. A node may still hold a copy
        # of that chunk id from before a truncate (garbage not deleted yet): the first range of the
        # session replaces it, zeros in front, so none of its old bytes come back.
        fresh = ref.version == 0 and dc.index not in of.uncommitted
        if not fresh and not dc.contiguous:  # the gaps hold stored bytes this mount does not have
            if len(dc.ranges) <= 2:  # a send per range: each node merges it into its copy
                for piece in dc.pieces():
                    await self._send_chunk(of, piece, sync=sync)
                return
            dc = await self._filled(of, dc)  # read once, fill the gaps here, one send
        lo = 0 if fresh else dc.lo
        payload = memoryview(dc.buf)[lo : dc.hi]  # buf holds zeros before dc.lo and in the gaps (holes, when fresh)
        request = p.WriteChunkReq(
            chunk=chunk, version=epoch, base_version=ref.version, offset=lo, xxh3=xxhash.xxh3_64_intdigest(payload),
            sync=sync, replace=fresh,
        )
        failed: dict[int, StripefsError] = {}
        done: list[int] = []
        # a chunk this session wrote already lives only on the nodes that took it: never followed
        follow = dc.index not in of.uncommitted
        send = lambda node_id: self.nodes.write(node_id, request, payload)  # noqa: E731
        ref = await self._send_to_replicas(of, ref, send, done, failed, follow=follow)

        nodes = list(ref.nodes)
        for node_id, exc in failed.items():
            if not done:
                break
            if exc.code == ErrorCode.STALE:
                # this copy missed earlier writes: give it the whole chunk
                await self._copy_whole(of, chunk, epoch, done[0], node_id, sync)
                done.append(node_id)
                continue
            log.warning("chunk %s: write to node %d failed (%s); moving that copy", chunk, node_id, exc)
            rsp = await self.meta.call(p.ReplaceReplicaReq(ino=of.ino, index=dc.index, failed_node=node_id))
            self.nodes.learn(rsp.nodes)
            new_ref = rsp.chunks[0]
            nodes = list(new_ref.nodes)
            for new_node in set(new_ref.nodes) - set(ref.nodes):
                await self._copy_whole(of, chunk, epoch, done[0], new_node, sync)
                done.append(new_node)
        if not done:
            codes = {exc.code for exc in failed.values()}
            first = next(iter(failed.values()))
            log.error("chunk %s: no replica took the write: %s", chunk, "; ".join(f"node {n}: {e}" for n, e in failed.items()))
            raise StripefsError(ErrorCode.NO_SPACE if codes == {ErrorCode.NO_SPACE} else first.code, first.message)
        nodes = [n for n in nodes if n in done]
        of.record(p.ChunkRef(index=dc.index, version=epoch, nodes=nodes))
        self.cache.drop_chunk(of.ino, dc.index)  # reads of the chunk's old bytes in flight are stale now
        if not sync:
            of.unsynced[dc.index] = nodes

    async def _filled(self, of: OpenFile, dc: DirtyChunk) -> DirtyChunk:
        """``dc``'s ranges over the chunk's current bytes (this session's version if it wrote
        one), as one range from 0: instead of a read-merge-rename of the chunk on every node
        for every range (writers of records that leave gaps)."""
        stored = await self._chunk_bytes(of, dc.index)
        buf = bytearray(memoryview(stored)[: dc.hi])
        buf += bytes(dc.hi - len(buf))  # past the stored bytes: a hole
        for lo, hi in dc.ranges:
            buf[lo:hi] = memoryview(dc.buf)[lo:hi]
        return DirtyChunk(dc.index, buf, 0, dc.hi)

    async def _send_to_replicas(
        self, of: OpenFile, ref: p.ChunkRef, send, done: list[int], failed: dict[int, StripefsError], *, follow: bool
    ) -> p.ChunkRef:
        """``await send(node_id)`` on every node of ``ref``; the placement the rest of the send goes by.

        ``follow`` (a chunk whose map is the committed one): when no node took it, or one answered
        STALE (its copy may have been moved away and deleted), ask the daemon where the chunk is now
        and send to the nodes of that placement not tried yet (client/placements.py). Then the
        current placement is the one to go by, and nodes it no longer names drop out of ``failed``
        (their copies are the daemon's garbage); unless only such nodes took the send: they hold
        the data, so they stay, and the commit names them."""
        await self._on_each(ref.nodes, send, done, failed)
        if not follow or not failed or (done and all(exc.code != ErrorCode.STALE for exc in failed.values())):
            return ref
        now = await moved(self.meta, self.nodes, of, ref)
        if now is None:
            return ref
        await self._on_each([n for n in now.nodes if n not in failed and n not in done], send, done, failed)
        placed = now if not done or any(n in done for n in now.nodes) else ref
        for node_id in [n for n in failed if n not in placed.nodes]:
            del failed[node_id]
        return placed

    @staticmethod
    async def _on_each(node_ids, send, done: list[int], failed: dict[int, StripefsError]) -> None:
        """``await send(node_id)`` for every node at once: those that took it appended to ``done``,
        the others' errors in ``failed``."""

        async def one(node_id: int) -> None:
            try:
                await send(node_id)
                done.append(node_id)
            except StripefsError as exc:
                failed[node_id] = exc

        async with trio.open_nursery() as nursery:
            for node_id in node_ids:
                nursery.start_soon(one, node_id)

    async def _copy_whole(self, of: OpenFile, chunk: p.ChunkId, epoch: int, source: int, target: int, sync: bool) -> None:
        data = await self.nodes.read(source, chunk, epoch, 0, of.chunk_size, last_try=True)
        await self.nodes.write(
            target,
            p.WriteChunkReq(
                chunk=chunk, version=epoch, base_version=0, offset=0, xxh3=xxhash.xxh3_64_intdigest(data), replace=True, sync=sync
            ),
            data,
        )

    async def flush(self, of: OpenFile, *, sync: bool = False) -> None:
        """Send every dirty range, wait for writes in flight, commit versions and size.

        Any part of that failing fails the write session: it is discarded and the error
        raised here, once (open_files.py); nothing of it is committed. One flush or
        truncate of a file at a time (``OpenFile.commit_lock``)."""
        async with of.commit_lock:
            await self._flush(of, sync=sync)

    async def _flush(self, of: OpenFile, *, sync: bool = False) -> None:
        wanted = kept = 0
        try:
            await self._store_all(of, sync=sync)
            if of.write_error is None and (of.uncommitted or of.written_end > of.attr.size):
                wanted, kept = await self._commit(of)
        except BaseException as exc:
            self._fail(of, exc)
            if isinstance(exc, trio.Cancelled):
                raise  # the next _settle discards the session; its error stays to be reported
            await self._settle(of)
        if of.write_error is not None:
            exc, of.write_error = of.write_error, None
            raise exc
        if kept < wanted:
            raise StripefsError(ErrorCode.QUOTA_EXCEEDED, f"inode {of.ino}: a directory quota kept {kept} of {wanted} bytes")

    async def _store_all(self, of: OpenFile, *, sync: bool) -> None:
        """Send every dirty range and wait for the sends in flight (``sync``: and fsync them), until
        nothing is left unsent, or the session failed (``of.write_error``).

        Until nothing is left: a WRITE through another descriptor of the file (or the kernel's
        writeback) may arrive while this waits, buffer a new chunk and move ``written_end``; the
        commit that follows, with no wait before it, must carry the chunk of the last byte its size
        covers (the daemon refuses it otherwise, daemon/file_data.py). A writer that never pauses
        keeps a close of another descriptor waiting as long."""
        while True:
            try:
                while of.dirty and of.write_error is None:
                    await self._send(of, of.take(min(of.dirty)), sync=sync)
            except StripefsError:
                pass  # the session failed (of.write_error): the caller reports it
            await self._settle(of)
            if of.write_error is not None:
                return
            if sync:
                await self._sync(of)
            if not (of.dirty or of.inflight):
                return

    async def _sync(self, of: OpenFile) -> None:
        """fsync, on their nodes, the chunks written since the last sync.

        A node that fails (it died after taking the write) loses its copies from the commit, as
        if the write to it had failed: the chunk is durable on its other replicas, and the daemon
        restores the copy count (daemon/repair.py). A chunk left with no durable copy fails."""
        await self.ec.sync(of)
        if not of.unsynced:
            return
        by_node: dict[int, list[p.ChunkId]] = {}
        # the slot of the chunk's newest version here: it holds every byte written to the chunk so far
        parts = {i: replica_part((of.uncommitted.get(i) or of.chunks.get(i) or p.ChunkRef(index=i, version=0, nodes=[])).version) for i in of.unsynced}
        for index, nodes in of.unsynced.items():
            for node_id in nodes:
                by_node.setdefault(node_id, []).append(p.ChunkId(of.ino, index, parts[index]))
        failed = await self.nodes.sync_each(by_node)
        synced = {index: [n for n in nodes if n not in failed] for index, nodes in of.unsynced.items()}
        lost = sorted(index for index, nodes in synced.items() if not nodes)
        if lost:
            first = failed[of.unsynced[lost[0]][0]]
            raise StripefsError(first.code, f"chunk {of.ino}:{lost[0]}: no replica could make it durable: {first.message}")
        for index, nodes in synced.items():
            ref = of.uncommitted.get(index)
            if ref is not None and len(nodes) < len(of.unsynced[index]):
                log.warning(
                    "chunk %d:%d: not durable on node(s) %s (%s); committed with its %d other copies, the daemon restores the rest",
                    of.ino, index, sorted(set(of.unsynced[index]) - set(nodes)),
                    "; ".join(str(failed[n]) for n in set(of.unsynced[index]) - set(nodes)), len(nodes),
                )
                of.record(p.ChunkRef(index=index, version=ref.version, nodes=[n for n in ref.nodes if n not in failed]))
        of.unsynced.clear()

    async def _commit(self, of: OpenFile) -> tuple[int, int]:
        """Commit the session's chunk versions and size (other mounts see them from now on);
        (the size asked, the size kept: less when a directory quota cut the commit)."""
        request, handed = self.commit_request(of)
        try:
            rsp = await self.meta.call(request)
        except BaseException:
            self.not_committed(of, handed)
            raise
        return await self.committed(of, rsp, handed)

    @staticmethod
    def commit_request(of: OpenFile) -> tuple[p.CommitReq, Handed]:
        """The CommitReq of ``of``'s session, which is handed over to it: writes arriving during
        the round trip belong to the next session. With what ``not_committed`` needs to take it back."""
        refs = sorted(of.uncommitted.values(), key=lambda c: c.index)
        handed = Handed(refs, of.before_session, of.written_end, of.mtime_ns, of.commit_sent(r.index for r in refs))
        of.uncommitted, of.before_session, of.written_end, of.epoch, of.mtime_ns = {}, {}, 0, 0, 0
        return p.CommitReq(ino=of.ino, size=handed.wanted, mtime_ns=handed.mtime_ns or time.time_ns(), chunks=refs), handed

    @staticmethod
    def not_committed(of: OpenFile, handed: Handed) -> None:
        """The commit is not known to be made: what it carried stays part of the session, which fails."""
        of.commit_answered(handed.answered)
        of.uncommitted = {**{r.index: r for r in handed.refs}, **of.uncommitted}
        of.before_session.update(handed.before)
        of.written_end = max(of.written_end, handed.wanted)
        of.mtime_ns = max(of.mtime_ns, handed.mtime_ns)

    async def committed(self, of: OpenFile, rsp: p.AttrRsp, handed: Handed) -> tuple[int, int]:
        """The daemon answered the session's CommitReq (``handed``, commit_request's): (the size
        asked, the size kept)."""
        wanted = handed.wanted
        of.commit_answered(handed.answered)
        self.on_commit(of.ino, rsp)
        of.attr = rsp.attr
        of.size = max(rsp.attr.size, of.written_end, wanted)  # wanted > the size: the quota cut below
        await self._release_unused(of)
        if rsp.attr.size < wanted:
            # a directory quota cut the commit (daemon/quota.py): drop our bytes past it
            await self._cut(of, rsp.attr.size)
        return wanted, rsp.attr.size

    async def _release_unused(self, of: OpenFile) -> None:
        """Give back placements made ahead (alloc_indices) past the end that nothing was written to.

        Best effort: a failure leaves version-0 rows, which read as zeros and go with the
        session's other uncommitted allocations."""
        unused = sorted(i for i in of.placed_ahead if i * of.chunk_size >= of.size)
        of.placed_ahead = frozenset()
        if not unused:
            return
        for i in unused:
            ref = of.chunks.get(i)
            if ref is not None and ref.version == 0:
                del of.chunks[i]
        try:
            await self.meta.call(p.ReleaseChunksReq(ino=of.ino, indices=unused))
        except StripefsError as exc:
            log.info("inode %d: releasing %d unused chunk placement(s) failed: %s", of.ino, len(unused), exc)

    # --------------------------------------------------------------- truncate

    async def truncate(self, of: OpenFile, new_size: int) -> p.Attr:
        """Cut or extend a file: the boundary chunk is cut on its replicas, then the daemon drops the rest."""
        async with of.commit_lock:
            await self._flush(of)
            return await self._cut(of, new_size)

    async def _cut(self, of: OpenFile, new_size: int) -> p.Attr:
        """Truncate with nothing left to flush: cut the boundary chunk, then tell the daemon."""
        cs = of.chunk_size
        index, inner = divmod(new_size, cs)
        refs: list[p.ChunkRef] = []
        ref = of.chunks.get(index)
        if inner and is_cold(ref) and new_size < of.size:  # the cut goes into its content: back on nodes first
            await recall(self.meta, self.nodes, of, [index])
            ref = of.chunks.get(index)
        if inner and ref is not None and ref.version and new_size < of.size and is_ec(of.layout):
            refs.append(await self.ec.cut_stripe(of, ref, inner))
        elif inner and ref is not None and ref.version and new_size < of.size:
            epoch = await slot_version(self.meta, of, await fresh_epoch(self.meta, of), ref.version)  # the cut goes to the other slot
            chunk = p.ChunkId(of.ino, index, replica_part(epoch))
            request = p.WriteChunkReq(
                chunk=chunk, version=epoch, base_version=ref.version, offset=inner,
                xxh3=xxhash.xxh3_64_intdigest(b""), truncate=inner,
            )
            ok: list[int] = []
            failed: dict[int, StripefsError] = {}
            cut = lambda node_id: self.nodes.write(node_id, request, b"")  # noqa: E731
            placed = await self._send_to_replicas(of, ref, cut, ok, failed, follow=True)  # flushed: the map is the committed one
            for node_id, exc in failed.items():
                log.warning("truncate of chunk %d:%d on node %d failed: %s", of.ino, index, node_id, exc)
            if not ok:
                raise StripefsError(ErrorCode.IO, f"no replica of chunk {of.ino}:{index} could be truncated")
            nodes = [n for n in placed.nodes if n in ok]
            for node_id, exc in failed.items():
                if exc.code == ErrorCode.STALE:  # it missed earlier writes: give it the whole cut chunk, as a write does
                    try:
                        await self._copy_whole(of, chunk, epoch, ok[0], node_id, False)
                        nodes.append(node_id)
                    except StripefsError as err:
                        log.warning("chunk %d:%d: copying the cut chunk to node %d failed (%s); repair restores it", of.ino, index, node_id, err)
            refs.append(p.ChunkRef(index=index, version=epoch, nodes=nodes))
        rsp = await self.meta.call(p.SetattrReq(ino=of.ino, size=new_size, chunks=refs))
        self.on_commit(of.ino, rsp)
        if new_size < of.size:
            # the chunks dropped are deleted on their nodes up to the newest epoch handed out, and
            # the cut one carries a fresh version: what is written next needs a newer epoch than ours
            of.epoch = 0
        of.attr = rsp.attr
        of.size = new_size
        keep = index + (1 if inner else 0)
        of.chunks = {i: c for i, c in of.chunks.items() if i < keep}
        for r in refs:
            of.chunks[r.index] = r
        self.cache.drop_inode(of.ino)
        return rsp.attr


def _piece(data: bytes | memoryview, offset: int, length: int) -> bytes | memoryview:
    """``length`` bytes of a chunk at ``offset``; past the chunk's stored end the file is a hole (zeros)."""
    piece = data[offset : offset + length]
    if len(piece) == length:
        return piece
    return bytes(piece) + bytes(length - len(piece))
