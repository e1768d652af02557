"""Self-healing, the storage node's side: peer copies, scrub, inventory, bad-copy reports.

The metadata daemon decides (daemon/repair.py); the storage nodes move the
bytes between themselves:

``CopyChunkReq``
    The daemon names a chunk, the version it must at least be, and the
    addresses of nodes holding it. This node reads the whole chunk from the
    first source that answers (``ReadChunkReq``: the source verifies every
    block it sends), checks the payload's xxh3, and stores it with
    ``replace`` and ``sync`` (temp file, fsync, rename, fsync of the
    directory): the copy is durable before the daemon records it. A copy
    already stored here that is at least as new (a writer moved its replica
    here meanwhile) is kept: a repair never labels old bytes with a newer
    version.

Background scrub
    A task walks the 65,536 fan-out directories in order and reads every
    block of every copy (``ChunkStore.verify``), throttled to
    ``scrub_bandwidth`` bytes/s; a pass starts ``scrub_interval_s`` after the
    previous one began, across restarts (``DATA_DIR/last-scrub-start``), or at
    once on ``ScrubStartReq``. ``scrub_bandwidth = 0`` turns it off.

Bad copies
    Any copy that fails its checksum here (a client's read, the background
    scrub) is queued and reported to the metadata daemon after the next
    heartbeat (``ReportBadChunksReq``); the daemon re-replicates it from a
    good copy and queues this one for deletion. ``VerifyChunksReq`` (the
    daemon's on-demand scrub) answers the bad ones directly instead.

``ListChunksReq``
    The inventory, a slice of fan-out directories per request, for fsck.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import trio
import xxhash
import zmq

from ..common import protocol as p
from ..common.config import StorageConfig
from ..common.errors import ErrorCode, StripefsError
from ..common.security import split_address
from ..common.transport import RpcClient, connect

from .chunk_store import ChunkStore

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 10.0  # one source; the next is tried after it (the daemon lists live ones first)
MAX_REPORT = 1000  # bad copies per ReportBadChunksReq
MAX_PEERS = 4096  # connections held to other storage nodes (repair sources)


class Healing:
    """The handlers and background tasks above, for one StorageService."""

    def __init__(self, config: StorageConfig, store: ChunkStore, ctx: zmq.Context, io: Callable[..., Any]):
        self.config = config
        self.store = store
        self.node_id = config.node_id
        self._ctx = ctx
        self._io = io  # StorageService._io: run in a worker thread under the I/O limiter
        self._peers: dict[str, RpcClient] = {}
        self._peer_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._bad: set[p.ChunkId] = set()
        self._scrub_now = trio.Event()
        self.scrubbed_passes = 0

    def handlers(self) -> dict[type, Callable]:
        return {
            p.CopyChunkReq: self.handle_copy_chunk,
            p.ReconstructFragmentReq: self.handle_reconstruct_fragment,
            p.VerifyChunksReq: self.handle_verify_chunks,
            p.ListChunksReq: self.handle_list_chunks,
            p.ScrubStartReq: self.handle_scrub_start,
        }

    # -- bad copies ------------------------------------------------------------

    def note_bad(self, chunk: p.ChunkId) -> None:
        """A copy failed its checksum here: report it with the next heartbeat."""
        self._bad.add(chunk)

    async def send_reports(self, meta: RpcClient) -> None:
        if not self._bad:
            return
        chunks = sorted(self._bad, key=lambda c: (c.ino, c.index, c.part))[:MAX_REPORT]
        await meta.call(p.ReportBadChunksReq(node_id=self.node_id, chunks=chunks))
        self._bad.difference_update(chunks)
        log.info("node %d: reported %d bad copies to the metadata daemon", self.node_id, len(chunks))

    # -- copies between nodes --------------------------------------------------

    async def _peer(self, address: str) -> RpcClient:
        """A held connection to another storage node (a StripefsError for an address that is none)."""
        if not p.is_endpoint(address):
            raise StripefsError(ErrorCode.BAD_REQUEST, f"source address {address[:100]!r} is not tcp://HOST:PORT")
        async with self._peer_lock:
            client = self._peers.get(address)
            if client is None:
                if len(self._peers) >= MAX_PEERS:  # every storage node of a large cluster fits; a flood of made-up ones does not
                    raise StripefsError(ErrorCode.UNAVAILABLE, f"already connected to {MAX_PEERS} peers; not to {address}")
                client = self._peers[address] = await self._nursery.start(self._hold, address)
            return client

    async def _hold(self, address: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with connect(self._ctx, address, timeout=PEER_TIMEOUT_S) as client:
            task_status.started(client)
            await trio.sleep_forever()

    async def handle_copy_chunk(self, req: p.CopyChunkReq, payloads) -> p.CopyChunkRsp:
        if self._nursery is None:
            raise StripefsError(ErrorCode.UNAVAILABLE, "node is starting")
        if req.source is not None:
            return await self._copy_local(req)
        errors = []
        arrived = trio.current_time()
        for address in req.sources:
            if split_address(address)[0] == self.config.address:  # itself (the address may name its key)
                continue
            try:
                client = await self._peer(address)
                rsp, frames = await client.call(
                    p.ReadChunkReq(chunk=req.chunk, min_version=req.min_version, offset=0, length=req.length)
                )
                data = frames[0] if len(frames) == 1 else None
                if data is None or xxhash.xxh3_64_intdigest(data) != rsp.xxh3:
                    raise StripefsError(ErrorCode.CORRUPT, "payload failed its checksum in transit")
            except StripefsError as exc:
                errors.append(f"{address}: {exc}")
                continue
            if req.deadline_s and trio.current_time() - arrived > req.deadline_s:
                # the daemon stops waiting soon after: a copy stored later would be an orphan
                raise StripefsError(ErrorCode.TIMEOUT, f"chunk {req.chunk}: copy not ready within {req.deadline_s:.1f}s; discarded")
            return await self._store_copy(req.chunk, rsp.version, data, address)
        raise StripefsError(ErrorCode.UNAVAILABLE, f"chunk {req.chunk}: no source could be read: {'; '.join(errors)}")

    async def _copy_local(self, req: p.CopyChunkReq) -> p.CopyChunkRsp:
        """A snapshot's copy-out: this node's copy of ``req.source`` at exactly ``min_version``
        stored as ``req.chunk`` (durable before the reply; never over a newer copy)."""
        version, data = await self._io(self.store.read, req.source, req.min_version, 0, req.length)
        if version != req.min_version:
            raise StripefsError(ErrorCode.STALE, f"chunk {req.source} is version {version}, not {req.min_version}")
        return await self._store_copy(req.chunk, version, data, req.source)

    async def _store_copy(self, chunk: p.ChunkId, version: int, data, origin) -> p.CopyChunkRsp:
        """A copy read from ``origin`` stored as ``chunk``: durable before the reply, never over a newer copy."""
        meta = await self._io(self.store.write, chunk, version, 0, 0, data, replace=True, sync=True, if_newer=True)
        log.info("node %d: chunk %s v%d copied from %s (%d bytes)", self.node_id, chunk, meta.version, origin, meta.length)
        return p.CopyChunkRsp(version=meta.version, length=meta.length)

    async def handle_reconstruct_fragment(self, req: p.ReconstructFragmentReq, payloads) -> p.CopyChunkRsp:
        if self._nursery is None:
            raise StripefsError(ErrorCode.UNAVAILABLE, "node is starting")
        from ..common.erasure import codec
        from ..common.layout import MAX_CHUNK_SIZE

        if not (0 <= req.fragment < req.k + req.m and 0 < req.chunk_size <= MAX_CHUNK_SIZE and 0 <= req.used <= req.chunk_size):
            raise StripefsError(
                ErrorCode.BAD_REQUEST,
                f"fragment {req.fragment} of ec={req.k}+{req.m}, chunk size {req.chunk_size}, used {req.used}: out of range",
            )
        arrived = trio.current_time()
        coder = codec(req.k, req.m, req.chunk_size)  # INVALID for a bad K+M
        got: dict[int, memoryview] = {}
        errors: list[str] = []

        async def fetch(src: p.FragmentSource) -> None:
            want = src.version or req.version  # a fragment's own version (common/protocol.ChunkRef ``fversions``)
            try:
                client = await self._peer(src.address)
                rsp, frames = await client.call(
                    p.ReadChunkReq(chunk=p.ChunkId(req.chunk.ino, req.chunk.index, src.part), min_version=want,
                                   offset=0, length=coder.fragment_size)
                )
                if rsp.version != want:
                    raise StripefsError(ErrorCode.STALE, f"fragment {src.index} is version {rsp.version}, not {want}")
                if len(frames) != 1 or xxhash.xxh3_64_intdigest(frames[0]) != rsp.xxh3:
                    raise StripefsError(ErrorCode.CORRUPT, "payload failed its checksum in transit")
                got[src.index] = frames[0]
            except StripefsError as exc:
                errors.append(f"fragment {src.index} at {src.address}: {exc}")

        async with trio.open_nursery() as nursery:
            for src in req.sources:
                if src.index != req.fragment:
                    nursery.start_soon(fetch, src)
        if len(got) < req.k:
            raise StripefsError(
                ErrorCode.UNAVAILABLE, f"chunk {req.chunk}: {len(got)} of {req.k} fragments readable: {'; '.join(errors)}"
            )
        chosen = dict(sorted(got.items())[: req.k])
        stripe = await self._io(coder.decode, chosen)
        fragment = (await self._io(coder.encode, stripe, req.used))[req.fragment]
        if req.deadline_s and trio.current_time() - arrived > req.deadline_s:
            raise StripefsError(ErrorCode.TIMEOUT, f"chunk {req.chunk}: fragment not ready within {req.deadline_s:.1f}s; discarded")
        meta = await self._io(self.store.write, req.chunk, req.version, 0, 0, fragment, replace=True, sync=True, if_newer=True)
        log.info("node %d: fragment %d of chunk %s v%d reconstructed from %d others (%d bytes)",
                 self.node_id, req.fragment, req.chunk, meta.version, len(chosen), meta.length)
        return p.CopyChunkRsp(version=meta.version, length=meta.length)

    # -- verification and inventory --------------------------------------------

    async def handle_verify_chunks(self, req: p.VerifyChunksReq, payloads) -> p.VerifyChunksRsp:
        if req.min_versions and len(req.min_versions) != len(req.chunks):
            raise StripefsError(ErrorCode.BAD_REQUEST, f"{len(req.min_versions)} min_versions for {len(req.chunks)} chunks")
        bad, missing, total = [], [], 0
        versions, digests, written = [], [], []
        for i, chunk in enumerate(req.chunks):
            try:
                seen = await self._io(self.store.check, chunk, req.min_versions[i] if req.min_versions else 0)
            except StripefsError as exc:
                if exc.code == ErrorCode.NOT_FOUND:
                    missing.append(chunk)
                elif exc.code in (ErrorCode.CORRUPT, ErrorCode.STALE):
                    bad.append(chunk)
                else:
                    raise
                versions.append(0)
                digests.append(0)
                written.append(0)
                continue
            total += seen.length
            versions.append(seen.version)
            digests.append(seen.digest)
            written.append(seen.written_ns)
        return p.VerifyChunksRsp(bad=bad, missing=missing, bytes=total, versions=versions, digests=digests, written_ns=written)

    async def handle_list_chunks(self, req: p.ListChunksReq, payloads) -> p.ListChunksRsp:
        if not 0 <= req.start_dir < ChunkStore.FANOUT_DIRS or req.max_dirs <= 0:
            raise StripefsError(ErrorCode.BAD_REQUEST, f"bad directory range {req.start_dir}+{req.max_dirs}")
        end = min(ChunkStore.FANOUT_DIRS, req.start_dir + min(req.max_dirs, 16384))
        chunks, versions = await self._io(self._list, req.start_dir, end)
        return p.ListChunksRsp(chunks=chunks, versions=versions, next_dir=end if end < ChunkStore.FANOUT_DIRS else -1)

    def _list(self, start: int, end: int) -> tuple[list[p.ChunkId], list[int]]:
        chunks, versions = [], []
        for d in (d for d in self.store.existing_dirs() if start <= d < end):
            for chunk in self.store.chunks_in_dir(d):
                try:
                    version = self.store.stat(chunk).version
                except StripefsError as exc:
                    if exc.code == ErrorCode.NOT_FOUND:
                        continue  # deleted meanwhile
                    version = 0  # unreadable header: listed, so fsck sees a bad copy
                chunks.append(chunk)
                versions.append(version)
        return chunks, versions

    async def handle_scrub_start(self, req: p.ScrubStartReq, payloads) -> p.OkRsp:
        self._scrub_now.set()
        return p.OkRsp()

    # -- background ------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._scrub_loop, name=f"storage-{self.node_id}-scrub")
            task_status.started()

    async def _scrub_loop(self) -> None:
        rate = int(self.config.scrub_bandwidth)
        while True:
            if rate <= 0:
                await self._scrub_now.wait()  # no background pass; on request, at full speed
            else:
                # the next pass is due scrub_interval_s after the last one began, restarts or not:
                # a node restarted every hour must not verify its whole disk every hour
                last = self._last_scrub_start()
                due = 0.0 if last is None else last + self.config.scrub_interval_s - time.time()
                if due > 0:
                    with trio.move_on_after(due):
                        await self._scrub_now.wait()
            self._scrub_now = trio.Event()  # a request from now on asks for another pass after this one
            self._record_scrub_start()
            try:
                await self._scrub_pass(rate)
            except OSError as exc:  # the disk is in trouble: say so, the node keeps serving
                log.error("node %d: scrub pass stopped: %s", self.node_id, exc)

    def _scrub_stamp(self) -> Path:
        return Path(self.config.data_dir) / "last-scrub-start"

    def _last_scrub_start(self) -> float | None:
        try:
            return float(self._scrub_stamp().read_text())
        except (OSError, ValueError):
            return None

    def _record_scrub_start(self) -> None:
        try:
            self._scrub_stamp().write_text(f"{time.time():.0f}\n")
        except OSError as exc:
            log.warning("node %d: cannot record the scrub start in %s: %s", self.node_id, self._scrub_stamp(), exc)

    async def _scrub_pass(self, rate: int) -> None:
        copies = nbytes = bad = 0
        budget_t = trio.current_time()
        dirs = await self._io(self.store.existing_dirs)
        for first in range(0, len(dirs), 64):
            chunks = await self._io(lambda: [c for d in dirs[first : first + 64] for c in self.store.chunks_in_dir(d)])
            for chunk in chunks:
                try:
                    n = await self._io(self.store.verify, chunk)
                except StripefsError as exc:
                    if exc.code == ErrorCode.CORRUPT:
                        bad += 1
                        self.note_bad(chunk)
                    elif exc.code != ErrorCode.NOT_FOUND:
                        log.warning("node %d: scrub of chunk %s failed: %s", self.node_id, chunk, exc)
                    continue
                copies += 1
                nbytes += n
                if rate:
                    budget_t = max(budget_t, trio.current_time() - 1.0) + n / rate
                    if budget_t > trio.current_time():
                        await trio.sleep_until(budget_t)
            await trio.sleep(0)
        self.scrubbed_passes += 1
        log.info("node %d: scrub pass %d done: %d copies, %d bytes verified, %d bad", self.node_id, self.scrubbed_passes, copies, nbytes, bad)
