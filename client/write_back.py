"""Small-file write-back (issue 31): a small new file's close returns at once; its data and commit
follow in batches.

A program writing many small files (``cp -r``, ``tar x``, a job saving its outputs)
waited at every close for a WriteChunkReq to each replica and a CommitReq. Here a
file whose last close finds all its data in the mount's buffer, as one new chunk
(``eligible``), is queued instead (``add``) and the close returns. A flusher sends
the queued files' chunks to each storage node in one ``WriteChunksReq``
(``NodePool.write_many``) and then their commits to the daemon in one
``BatchReq``, ``DELAY_S`` after the first of them was queued, or sooner:
``BATCH`` queued, or ``settle`` (the mount's ``Operations._settle``, before any
request naming the file or its directory: an open, a stat the mount cannot answer,
a write, an fsync of the file or FSYNCDIR of its directory, an unlink...), the
acknowledgement of another mount's change or read (``flush``, with the async
dirops': a second mount's lookup waits for it), and unmount.

The rules
---------
* A file created here asynchronously (client/async_dirops.py) does not wait for
  its create's answer at its first write any more: while the create is not sent,
  up to ``operations.EARLY_MAX`` of writes are kept as they came
  (``OpenFile.early``), on the FUSE session's reader thread
  (``Operations._write_here``: no trio task per WRITE); a close then queues the file with its create pending,
  and the batch sends the creates (one BatchReq), applies the kept writes with
  the layout and placement the answers give (``Operations._replay``), then
  sends the data and the commits. A request that must see the file first
  (a read, a stat, an open) does the same for it. So ``cp -r`` of small files
  makes no round trip per file. A create refused then (a quota, a name taken
  elsewhere) takes its kept data with it: nothing committed, the CephFS rule
  of async_dirops for the file's next operation.
* Only in a directory this mount holds whole, with inode numbers delegated
  (``Operations._may_write_back``: as for an asynchronous create), the file
  held too: another mount's lookup in the directory, or open of the file,
  then waits for this mount's acknowledgement, which sends the file first. A
  file merely held is not enough (another mount's open of it does not wait:
  tests/cluster/test_kernel_cache.py showed it read empty).
* Only a file this mount made and wrote whole: replicated layout, its one chunk
  placed and never written (version 0: sent whole, ``replace``), no range sent
  yet, no error, the session's epoch known. Anything else commits at close as
  before; ``-o sync_close`` commits every file at close (durable-at-close).
* A node that does not take its write in the batch: that file is sent again on
  its own (``DataPath._send``: the existing retries, STALE copies, replica moves),
  and fails as any write session does when that fails: nothing of it is
  committed (issue 14's rule), the error is logged and is the result of the
  file's next close or fsync here (the ``OpenFile`` stays, holding the error,
  until then).
* The commit of a batch: one ``BatchReq`` of CommitReqs, each applied on its own
  by the daemon; a refused one (a quota) fails that file's session the same way.
* At most ``MAX_QUEUED`` files and ``MAX_QUEUED_BYTES`` wait: a close past that
  waits for a batch to be sent (``room``), so a writer faster than the cluster
  is held back and the mount's memory stays bounded.
* A stat of a file waiting here is answered by the mount (``attr_of``, from its close until its
  commit is answered): the size written and the time of its last write, which its commit
  records as its mtime; held by the kernel for no time, so the commit's own answer (ctime: the
  daemon's clock, as an NFS client's attributes after a flush) replaces it at once. Written
  again meanwhile, it is not answered so.
* What close and fsync promise then (docs/design.md "The durability promise"):
  close of such a file returns before its data is stored; the data is committed
  within ``DELAY_S`` plus the round trips, or at the next fsync of the file or of
  its directory, which returns once it is durable. A kill -9 of the mount in
  between loses that file's data (its name stays, empty), nothing fsynced.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import AsyncExitStack
from typing import Callable

import msgspec
import trio
import xxhash

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError, error_from
from ..common.layout import is_ec, replica_part
from .batching import FlushTimer, count_down
from .open_files import OpenFile

log = logging.getLogger(__name__)

#: the longest a closed file waits here before it is sent (as async_dirops.DELAY_S)
DELAY_S = 0.1
#: files sent together at most (a WriteChunksReq per node takes 64 of them at a time)
BATCH = 256
#: what may wait here at most, files and their bytes: a close past it waits for a batch to be sent
#: (``room``), so a writer faster than its cluster is held back and the mount's memory stays bounded
MAX_QUEUED = 1024
MAX_QUEUED_BYTES = 64 << 20
#: files committed here without a sync whose copies an fsync still finds (WriteBack.sync)
UNSYNCED_KEPT = 8192


class WriteBack:
    def __init__(self, data, *, on_done: Callable[[OpenFile], None] = lambda of: None, prepare=None) -> None:
        self.data = data  # client/striping.py DataPath
        self.on_done = on_done  # Operations: a queued file was committed or failed (its state may go)
        #: Operations: before a batch is sent, its files' creates are sent and the writes kept for them applied
        self.prepare = prepare
        self._queue: dict[int, OpenFile] = {}  # ino -> file, in the order they were closed
        self._sending: set[int] = set()  # inodes of the batch being sent
        #: ino -> (file, the attributes its commit will record), from its close until its commit is
        #: answered: a stat meanwhile is answered with them (``attr_of``)
        self._closed_attrs: dict[int, tuple[OpenFile, p.Attr]] = {}
        self._queued_bytes = 0
        self._counted: dict[int, int] = {}  # ino -> the bytes its queue entry counts in _queued_bytes
        self._parents: dict[int, int] = {}  # directory -> its files queued or being sent
        self._send_lock = trio.Lock()
        self._timer = FlushTimer()
        self.running = False
        #: ino -> node -> its copy, of files committed here without a sync: an fsync after the file's
        #: state left the mount still syncs them (``sync``); the newest ``UNSYNCED_KEPT``
        self._unsynced: OrderedDict[int, dict[int, list[p.ChunkId]]] = OrderedDict()
        self.sent = 0  # files committed through here
        self.failed = 0  # files whose data could not be stored here

    @staticmethod
    def eligible(of: OpenFile) -> bool:
        """A file whose data can wait: new, one chunk, all of it buffered here (module docstring)."""
        if of.write_error is not None or of.inflight or of.uncommitted or not of.epoch or of.open_count > 1 or not of.parent:
            return False
        if is_ec(of.layout) or len(of.dirty) != 1 or 0 not in of.dirty or of.size > of.chunk_size:
            return False
        ref = of.chunks.get(0)
        return ref is not None and ref.version == 0 and bool(ref.nodes) and len(of.chunks) == 1 and of.dirty[0].hi <= of.chunk_size

    def add(self, of: OpenFile) -> None:
        """Queue a closed file (``eligible``); sent within DELAY_S, or sooner. A file queued already
        (written again after its close while its create was not sent: its idle commit queues it
        again) keeps its one entry: its bytes counted anew, its directory once."""
        again = of.ino in self._queue
        if again:
            self._queued_bytes -= self._counted[of.ino]
        self._queue[of.ino] = of
        self._counted[of.ino] = of.size
        if of.mtime_ns:
            attr = msgspec.structs.replace(of.attr, size=of.size, mtime_ns=of.mtime_ns,
                                           ctime_ns=max(of.attr.ctime_ns, of.mtime_ns))
            self._closed_attrs[of.ino] = (of, attr)
        self._queued_bytes += of.size
        if not again:
            self._parents[of.parent] = self._parents.get(of.parent, 0) + 1
        self._timer.queued(first=len(self._queue) == 1, full=len(self._queue) >= BATCH)

    def attr_of(self, ino: int) -> p.Attr | None:
        """The attributes file ``ino`` will have once its commit is made, from its close until the
        commit is answered (None otherwise, or once it was written again: its size or the time of
        its last write changed; a commit's hand-over clears that time, which then still matches)."""
        closed = self._closed_attrs.get(ino)
        if closed is None:
            return None
        of, attr = closed
        if of.size != attr.size or of.mtime_ns not in (0, attr.mtime_ns):
            return None
        return attr

    def holds(self, ino: int) -> bool:
        """``ino`` is queued or being sent: its close is answered, its commit is not."""
        return ino in self._queue or ino in self._sending

    def busy(self, *inodes: int) -> bool:
        """Some of these inodes, or a file in these directories, waits here."""
        if not self._parents:
            return False
        return not inodes or any(ino in self._queue or ino in self._sending or ino in self._parents for ino in inodes)

    async def room(self) -> None:
        """A close that queued a file: it waits for the queue to be sent when it holds MAX_QUEUED files
        or MAX_QUEUED_BYTES (backpressure)."""
        if len(self._queue) >= MAX_QUEUED or self._queued_bytes >= MAX_QUEUED_BYTES:
            await self.flush()

    async def settle(self, *inodes: int) -> None:
        """Return once the files of these inodes or directories (all, when none is named) are committed
        or failed. Everything queued goes with them: one batch, in order."""
        if self.busy(*inodes):
            await self.flush()

    async def flush(self, *, sync: bool = False) -> None:
        """Send everything queued now and wait for the daemon's answers (``sync``: durable on the nodes)."""
        async with self._send_lock:
            while self._queue:
                batch = list(self._queue.values())[:BATCH]
                for of in batch:
                    del self._queue[of.ino]
                    self._queued_bytes -= self._counted.pop(of.ino)
                    self._sending.add(of.ino)
                try:
                    await self._send(batch, sync)
                finally:
                    for of in batch:
                        self._sending.discard(of.ino)
                        self._closed_attrs.pop(of.ino, None)
                        count_down(self._parents, of.parent)
                        self.on_done(of)

    async def _send(self, batch: list[OpenFile], sync: bool) -> None:
        data = self.data
        if self.prepare is not None:
            await self.prepare(batch)
        async with AsyncExitStack() as locks:
            for of in batch:  # a truncate or another flush of one of them waits for this batch
                await locks.enter_async_context(of.commit_lock)
            others = [of for of in batch if not self.eligible(of)]  # written again since its close
            ours = [of for of in batch if of not in others]
            taken = {of.ino: of.take(0) for of in ours}
            by_node: dict[int, list[tuple[p.WriteChunkReq, memoryview]]] = {}
            owners: dict[int, list[int]] = {}
            for of in ours:
                dc, epoch = taken[of.ino], of.epoch
                payload = memoryview(dc.buf)[: dc.hi]
                request = p.WriteChunkReq(chunk=p.ChunkId(of.ino, 0, replica_part(epoch)), version=epoch, base_version=0,
                                          offset=0, xxh3=xxhash.xxh3_64_intdigest(payload), replace=True)
                for node_id in of.chunks[0].nodes:
                    by_node.setdefault(node_id, []).append((request, payload))
                    owners.setdefault(node_id, []).append(of.ino)
            stored: dict[int, set[int]] = {of.ino: set() for of in ours}

            async def to_node(node_id: int) -> None:
                try:
                    results = await data.nodes.write_many(node_id, by_node[node_id], sync=sync)
                except StripefsError as exc:
                    log.info("storage node %d: a batch of %d small files failed (%s); each is sent again on its own",
                             node_id, len(by_node[node_id]), exc)
                    return
                for ino, result in zip(owners[node_id], results):
                    if not isinstance(result, StripefsError):
                        stored[ino].add(node_id)

            async with trio.open_nursery() as nursery:
                for node_id in by_node:
                    nursery.start_soon(to_node, node_id)
            again = []
            for of in ours:
                dc, nodes = taken[of.ino], of.chunks[0].nodes
                if stored[of.ino] != set(nodes):
                    again.append(of)
                    continue
                of.record(p.ChunkRef(index=0, version=of.epoch, nodes=list(nodes)))
                data.cache.drop_chunk(of.ino, 0)
                if not sync:
                    of.unsynced[0] = list(nodes)
                of.sent(dc)

            async def send_alone(of: OpenFile) -> None:
                try:  # the usual path: retries, STALE copies, replica moves; its failure fails the session
                    await data._send(of, taken[of.ino], sync=sync)
                except StripefsError:
                    pass  # in of.write_error

            async with trio.open_nursery() as nursery:  # at once: a dead node costs one timeout, not one a file
                for of in again:
                    nursery.start_soon(send_alone, of)
            for of in others:  # the usual flush, under the lock held here
                await self._flush_alone(of, sync)
            await self._commit(ours, sync)

    async def _flush_alone(self, of: OpenFile, sync: bool) -> None:
        try:
            await self.data._flush(of, sync=sync)
        except StripefsError as exc:
            self._lost(of, exc)

    async def _commit(self, files: list[OpenFile], sync: bool) -> None:
        data = self.data
        for of in files:
            await data._settle(of)  # a failed session is thrown away here (its error kept for the next close)
        ready = [of for of in files if of.write_error is None]
        if sync:  # copies sent without a sync before (the write of a range never is here)
            for of in ready:
                try:
                    await data._sync(of)
                except StripefsError as exc:
                    data._fail(of, exc)
                    await data._settle(of)
            ready = [of for of in ready if of.write_error is None]
        for of in files:
            if of.write_error is not None:
                self._lost(of, of.write_error)
        if not ready:
            return
        requests = [data.commit_request(of) for of in ready]
        try:
            results = await data.meta.call_batch([r for r, _ in requests])
        except StripefsError as exc:  # the daemon could not be reached within the retry window
            results = [p.ErrorRsp(code=int(exc.code), message=exc.message)] * len(ready)
        except BaseException:  # cancelled: the sessions are not known to be committed
            for of, (_, handed) in zip(ready, requests):
                data.not_committed(of, handed)
            raise
        for of, (request, handed), result in zip(ready, requests, results):
            if isinstance(result, p.ErrorRsp):
                data.not_committed(of, handed)
                data._fail(of, error_from(result.code, result.message))
                await data._settle(of)
                self._lost(of, of.write_error)
                continue
            try:
                wanted, kept = await data.committed(of, result, handed)
            except StripefsError as exc:
                self._lost(of, exc)
                continue
            self.sent += 1
            if of.unsynced.get(0) and len(of.chunks) == 1:
                part = replica_part(of.chunks[0].version)
                self._unsynced[of.ino] = {n: [p.ChunkId(of.ino, 0, part)] for n in of.unsynced[0]}
                while len(self._unsynced) > UNSYNCED_KEPT:
                    self._unsynced.popitem(last=False)
            if kept < wanted:
                self._lost(of, StripefsError(ErrorCode.QUOTA_EXCEEDED, f"inode {of.ino}: a directory quota kept {kept} of {wanted} bytes"))

    async def sync(self, ino: int) -> None:
        """fsync of ``ino``: its copies written back without a sync (a file closed, committed here, and
        opened again) are made durable too. A copy no node could sync: IO."""
        by_node = self._unsynced.pop(ino, None)
        if not by_node:
            return
        failed = await self.data.nodes.sync_each(by_node)
        if failed and len(failed) == len(by_node):
            first = next(iter(failed.values()))
            raise StripefsError(first.code, f"inode {ino}: no copy written back could be made durable: {first.message}")
        if failed:  # committed with copies that did not sync: as a node lost after the commit (repair restores them)
            log.warning("inode %d: copies on node(s) %s could not be synced (%s)", ino, sorted(failed),
                        "; ".join(str(e) for e in failed.values()))

    def _lost(self, of: OpenFile, exc: BaseException | None) -> None:
        """A queued file's data could not be stored, or not all of it: logged, and its next close or
        fsync here reports ``exc`` (``OpenFile.write_error``, kept with the file's state)."""
        self.failed += 1
        of.write_error = exc if isinstance(exc, StripefsError) else StripefsError(ErrorCode.IO, f"written back: {exc!r}")
        log.error("inode %d: data written back after its close was not stored (%s); its next close or fsync "
                  "reports it", of.ino, of.write_error)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The flusher: sends what is queued DELAY_S after the first of it, or once BATCH wait."""
        self.running = True
        try:
            task_status.started()
            await self._timer.run(self.flush, lambda: DELAY_S)
        finally:
            self.running = False
