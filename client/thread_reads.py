"""Cold READs served on plain threads: no trio task, no event-loop wake-up, per request.

Under trio, a READ that misses the caches cost the mount a cross-thread hand-off, a task, a
nursery and cancel scopes for the hedged read, memory channels, the RpcClient's receive loop and
its wake-ups: about as much CPU as the rest of the request together (bench/dataloader.py
--profile, docs/design.md "Cold reads on plain threads"). Here the FUSE reader thread decides
(``Operations.thread_read``, under ``Operations.lock``) and queues the READ; one of a few worker
threads sends a ReadChunkReq on its own blocking DEALER to the replica a trio read would ask first,
waits with ``zmq.Poller`` (a replica that has not answered within ``hedge_after_s`` is joined by
the next one, as ``DataPath._hedged_read`` does; the first good answer wins), checks the payload's
xxh3, writes the FUSE reply itself, and stores the chunk in the chunk cache (``ChunkCache.keep``,
under the cache's own lock: no wake-up of the trio thread). A load the reader thread starts is
sent by the reader thread itself where it can be without waiting (client/reader_loads.py); the
workers take the rest.

What a worker may touch, and what it hands to trio (``TrioToken.run_sync_soon``, no lock held
across a network wait): it reads the load (made on the reader thread from state it may read under
the lock, or on the trio thread), ``NodePool.addresses`` and the suspect times (plain dict reads), and owns its sockets;
the suspect marks and anything else trio's tasks change are changed by a callback on the trio
thread; the chunk cache, which has a lock of its own, directly. A committed chunk version never changes, so storing it late is never wrong.

Anything not plain goes back to trio's path (``slow()``), which answers with the same result as
before: an error answer or a corrupt payload from every replica, no answer within ``read_timeout``
(the replicas asked are then marked suspect first, so the retry asks another), a socket that
cannot send, a pool that is closing or too far behind. The sockets carry the mount's CURVE key
(they are made from the mount's context, as NodePool's are) and the capability ``CapStore`` holds;
one that needs renewing goes to trio.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable, NamedTuple

import trio
import xxhash
import zmq

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import is_ec, replica_part
from ..common.transport import new_socket
from . import metrics, worker_threads
from .chunk_cache import ChunkCache
from .data_rpc import NodePool
from .placements import is_cold
from .reader_loads import ReaderLoads

log = logging.getLogger(__name__)

#: worker threads (each with one DEALER per node it has read from)
WORKERS = 4
#: READs queued beyond this go to trio's path instead (the workers are that far behind)
MAX_QUEUED = 256
#: a new socket is given this long to connect before its send counts as failed (IMMEDIATE is set)
CONNECT_WAIT_S = 1.0
_POLL_STOP_S = 0.2  # how soon a worker waiting on the network notices the pool is closing

_ids = itertools.count(1 << 40)  # request ids of their own (the trio clients count from 1)


class Waiter(NamedTuple):
    """A READ waiting for a chunk: answered from it, or handed to trio's path (``slow``)."""

    reply: object  # client.fuse.replies.Reply
    slow: Callable[[], None]
    offset: int  # of the READ in the chunk
    length: int  # bytes answered at most (past the chunk's stored end: zeros)
    started: float  # perf_counter at the READ's arrival
    #: (Jobs, the handler's arguments, by inode) while training jobs report (client/jobs.py): the READ
    #: is attributed to its job on the trio thread, as client/metrics.py's wrapper does
    account: tuple | None = None
    #: the kernel keeps what this READ is answered in its page cache (False: the file was opened
    #: O_DIRECT, whose reads bypass it)
    cached: bool = True


class Load:
    """One network read of one chunk, by a worker, and the READs waiting for it."""

    __slots__ = ("key", "request", "order", "exact", "ahead", "waiters")

    def __init__(self, key, request: p.ReadChunkReq, order: list[int], *, exact: bool = False, ahead: bool = False):
        self.key = key  # the chunk cache's (ino, index, version)
        self.request = request  # the whole chunk from offset 0 (what a trio read asks)
        self.order = order  # replicas, in the order trio's read would ask them
        self.exact = exact  # a read hint's guess: kept only at exactly the key's version
        self.ahead = ahead  # counted as read-ahead in the chunk cache (fetched, then used or wasted)
        self.waiters: list[Waiter] = []


def chunk_request(pool: "ThreadReads", ino: int, ref: p.ChunkRef, length: int) -> p.ReadChunkReq | None:
    """The ReadChunkReq a trio read of ``ref`` sends (its capability too), or None: trio's (a
    replica unknown or suspect, a capability to renew)."""
    if not pool.healthy(ref.nodes):
        return None
    chunk = p.ChunkId(p.data_ino(ino, ref), ref.index, replica_part(ref.version))  # as DataPath reads it
    cap = pool.nodes.caps.held(chunk.ino)
    if cap is False:
        return None  # to be renewed first: trio's
    return p.ReadChunkReq(chunk=chunk, min_version=ref.version, offset=0, length=length, cap=cap)


def plan_read(of, offset: int, size: int, data, pool: "ThreadReads", reply, slow, started: float,
              account: tuple | None = None, cached: bool = True) -> bool:
    """(reader thread, under Operations.lock) Take a READ of ``of`` (an OpenFile with nothing of
    this mount's own: Operations.thread_read_file), or False: trio's path. Taken: a read within
    one chunk of a replicated file, that chunk the file's last (so the read-ahead window, which is
    trio's state, has nothing to fetch), committed and on nodes (not in a tier), no disk cache
    to look in first, not being loaded by trio (the READ shares that load there). Answered at once
    from the chunk cache or a load just done here; else it waits for this pool's load of the chunk
    (one a LOOKUP started: ``fetch_soon``) or starts one."""
    end = min(offset + size, of.size)
    if end <= offset or is_ec(of.layout) or data.disk_cache is not None:
        return False
    cs = of.chunk_size
    index = offset // cs
    if (end - 1) // cs != index or (index + 1) * cs < of.size:
        return False
    ref = of.chunks.get(index)
    if ref is None or ref.version == 0 or is_cold(ref) or not ref.nodes:
        return False
    key = (of.ino, index, ref.version)
    if data.cache.loading(key):
        return False
    waiter = Waiter(reply, slow, offset - index * cs, end - offset, started, account, cached)
    return pool.read(key, waiter, lambda: chunk_request(pool, of.ino, ref, cs), pool.order(ref.nodes, of.ino + index))


def decode_reply(frames) -> tuple[int, object] | None:
    """(request id, body) of a received reply; None (logged) if it cannot be decoded."""
    try:
        return p.decode_reply(frames[0].bytes)
    except p.ProtocolError as exc:
        log.warning("undecodable reply to a thread read: %s", exc)
        return None


def _account(account: tuple, piece, seconds: float, network: float) -> None:
    """(trio thread) A READ answered here, attributed to its training job (Jobs.account)."""
    jobs, args, by_inode = account
    jobs.account("read", args, piece, seconds, network, by_inode)


def kernel_holds_all(waiters: list[Waiter], data) -> bool:
    """Whether answering ``waiters`` put every stored byte of the chunk ``data`` in the kernel's page
    cache: one of them read it from its start to its stored end, for a file the kernel caches.

    Such a chunk is not kept in the chunk cache (``ThreadReads.loaded``): the kernel answers the
    file's next reads itself, so a second copy in the mount would only be memory, and memory the
    mount keeps is memory libzmq cannot reuse: each received reply then lands in fresh pages (28
    page faults and their zeroing per 110 KiB on libzmq's I/O thread, about as much of the mount's
    CPU as the whole READ's Python; docs/design.md, "The cold small-file read: where the CPU
    goes"). A partial read keeps it (the next READ of the chunk needs it), as does an O_DIRECT one."""
    stored = len(data)
    return any(w.cached and w.offset == 0 and w.length >= stored for w in waiters)


def _piece(data, offset: int, length: int):
    piece = data[offset : offset + length]
    if len(piece) < length:  # past the chunk's stored end: a hole (zeros)
        piece = bytes(piece) + bytes(length - len(piece))
    return piece


class ThreadReads:
    """The worker threads and their queue (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, nodes: NodePool, cache: ChunkCache, token: trio.lowlevel.TrioToken, *,
                 hedge_after_s: float, workers: int = WORKERS, reader_loads: bool = True):
        self._ctx = ctx
        self.nodes = nodes
        self.cache = cache
        self._token = token
        self.hedge_after_s = hedge_after_s if hedge_after_s > 0 else float("inf")
        self.read_timeout = nodes.read_timeout
        # trio's clock (SystemClock: an offset plus perf_counter), to read the suspect marks here
        self._clock_offset = trio.current_time() - time.perf_counter()
        self._queue: queue.SimpleQueue[Load | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # around _loading and _done (reader thread, trio thread, workers)
        self._loading: dict[tuple, Load] = {}  # key -> its load, queued or under way
        self._done: dict[tuple, memoryview] = {}  # key -> its bytes, until they are in the chunk cache
        self._closing = False
        self._served, self._handed_back = metrics.THREAD_READS.labels("served"), metrics.THREAD_READS.labels("handed_back")
        self._fetched = metrics.THREAD_READS.labels("fetched")
        # label children resolved once: ``labels()`` takes a lock and hashes on every call (about
        # 2.5 us each here, three per READ answered)
        self._read_ops, self._read_latency = metrics.FUSE_OPS.labels("read"), metrics.FUSE_SECONDS.labels("read")
        self._read_network, self._read_cached = metrics.READ_SECONDS.labels("network"), metrics.READ_SECONDS.labels("cache")
        self.ids = _ids
        #: the FUSE reader thread's own loads (client/reader_loads.py: ``Session.side``), or None
        self.reader = ReaderLoads(self) if reader_loads else None
        self._threads = worker_threads.start(self._work, "thread-reads", workers)

    @property
    def ctx(self) -> zmq.Context:
        return self._ctx

    @property
    def closing(self) -> bool:
        return self._closing

    decode = staticmethod(decode_reply)

    def queue(self, load: Load) -> None:
        """(the reader thread) A load the reader thread began, for a worker to go on with."""
        self._queue.put(load)

    # -- the reader thread's side

    def healthy(self, node_ids: list[int]) -> bool:
        """Every replica's address is known and none is suspect (a node that timed out lately: trio's
        path asks it last, and reports what fails)."""
        now = self._clock_offset + time.perf_counter()
        addresses = self.nodes.addresses
        return all(n in addresses and self.nodes.suspect_until(n) <= now for n in node_ids)

    def order(self, node_ids: list[int], start: int) -> list[int]:
        """Replica order, as NodePool.order rotates it (none is suspect here: ``healthy``)."""
        k = start % len(node_ids)
        return node_ids[k:] + node_ids[:k]

    def read(self, key, waiter: Waiter, request, order: list[int]) -> bool:
        """(reader thread) Answer ``waiter`` from the chunk ``key``: at once when it is held, else when
        this pool's load of it ends (started here if none is under way; ``request()`` makes its
        ReadChunkReq). False: trio's path (the request could not be made, or the pool is full)."""
        data = self.cache.peek(key)
        if data is not None:
            if self.cache.touch(key):  # as ChunkCache.fetch counts a hit
                metrics.CACHE_HITS.inc()
            self._answer(waiter, data, cached=True)
            return True
        with self._lock:
            data = self._done.get(key)
            load = self._loading.get(key) if data is None else None
            if load is not None:
                load.waiters.append(waiter)
                return True
        if data is not None:
            self._answer(waiter, data, cached=True)
            return True
        if self._closing or self._queue.qsize() >= MAX_QUEUED:
            return False
        made = request()
        if made is None:
            return False
        if self.cache.prefetching(key):
            metrics.PREFETCH_RACE.labels("loaded_again").inc()
        load = Load(key, made, order)
        load.waiters.append(waiter)
        with self._lock:
            if key in self._loading:  # (a LOOKUP's fetch started meanwhile, on the trio thread)
                self._loading[key].waiters.append(waiter)
                return True
            self._loading[key] = load
        reader = self.reader
        if reader is None or reader.owner != threading.get_ident() or not reader.start(load):
            self._queue.put(load)
        return True

    # -- the trio thread's side

    def fetch_soon(self, want) -> bool:
        """(trio thread: DataPath.fetch_soon) Load a LOOKUP's one-chunk file (``Fetch.small_file``)
        or a read hint's chunk (``Fetch.hinted``: exactly its version) here, so that its READ is
        answered without trio; False: trio fetches it (a read-ahead of an open file, a replica
        unknown or suspect, a full pool)."""
        ref = want.ref
        if want.of is not None or ref is None or self._closing or self._queue.qsize() >= MAX_QUEUED:
            return False
        key = (want.ino, want.index, ref.version)
        with self._lock:
            if key in self._loading or key in self._done:
                return True
        request = chunk_request(self, want.ino, ref, want.length)
        if request is None:
            return False
        load = Load(key, request, self.order(ref.nodes, want.ino + want.index), exact=want.exact, ahead=want.ahead)
        with self._lock:
            if key in self._loading:
                return True
            self._loading[key] = load
        self._queue.put(load)
        return True

    # -- the end

    def close(self) -> None:
        """Stop the workers (what is queued goes to trio's path, which answers or finds the
        connection gone) and wait for them; each closes its own sockets."""
        self._closing = True
        worker_threads.stop(self._queue, self._threads)

    # -- a worker

    def _work(self) -> None:
        sockets: dict[str, tuple[zmq.Socket, float]] = {}  # address -> (its DEALER, when made)
        poller = zmq.Poller()
        try:
            while True:
                load = self._queue.get()
                if load is None:
                    return
                data = None
                if not self._closing:
                    try:
                        data = self._read(load, sockets, poller)
                    except Exception:  # a bug here: trio's path answers
                        log.exception("a thread read of chunk %s failed", load.request.chunk)
                try:
                    self.loaded(load, data)
                except Exception:  # a bug: logged; the worker goes on (its waiters' answers may be lost)
                    log.exception("answering the reads of chunk %s failed", load.request.chunk)
        finally:
            for sock, _ in sockets.values():
                sock.close(linger=0)

    def loaded(self, load: Load, data: memoryview | None) -> None:
        """A load ended (``data`` None: it failed): its waiters answered, or given to trio's path."""
        with self._lock:
            del self._loading[load.key]
            if data is not None:
                self._done[load.key] = data
            waiters = load.waiters
        if data is not None:
            try:
                for w in waiters:
                    self._answer(w, data)
            finally:
                # into the chunk cache here, not by a callback on the trio thread (a wake-up of the
                # event loop per load): ChunkCache.keep takes the cache's own lock; not at all when
                # the kernel's page cache now holds all of it (kernel_holds_all)
                metrics.CACHE_MISSES.inc()
                if not kernel_holds_all(waiters, data):
                    self.cache.keep(load.key, data, ahead=load.ahead and not waiters)
                with self._lock:
                    self._done.pop(load.key, None)
            if not waiters:
                self._fetched.inc()
            return
        for w in waiters:
            self._handed_back.inc()
            w.slow()

    def _answer(self, w: Waiter, data: memoryview, cached: bool = False) -> None:
        piece = _piece(data, w.offset, w.length)
        w.reply.data(piece)
        elapsed = time.perf_counter() - w.started
        if cached:  # (the reader thread's plain counters, as for its other answers from memory)
            metrics.observe("read", elapsed)
            self._read_cached.inc(elapsed)
        else:
            self._served.inc()
            self._read_ops.inc()
            self._read_latency.observe(elapsed)
            self._read_network.inc(elapsed)
        metrics.READ_BYTES.inc(len(piece))
        if w.account is not None:
            try:
                self._token.run_sync_soon(worker_threads.logged_callback, _account, w.account, piece, elapsed, 0.0 if cached else elapsed)
            except trio.RunFinishedError:
                pass

    def _socket(self, address: str, sockets: dict) -> tuple[zmq.Socket, float]:
        held = sockets.get(address)
        if held is None:
            held = sockets[address] = (new_socket(self._ctx, zmq.DEALER, connect=address), time.monotonic())
        return held

    def _send(self, node_id: int, load: Load, sockets: dict, poller: zmq.Poller, asked: dict, registered: set) -> bool:
        """Ask ``node_id`` for the chunk; False if it cannot be sent (not connected: a dead node)."""
        address = self.nodes.addresses.get(node_id)
        if address is None:
            return False
        sock, made = self._socket(address, sockets)
        request_id = next(_ids)
        frame = p.encode(request_id, load.request)
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            wait = CONNECT_WAIT_S - (time.monotonic() - made)
            if wait <= 0 or not sock.poll(int(wait * 1000), zmq.POLLOUT):
                return False  # IMMEDIATE: no live connection to queue it on
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                return False
        if sock not in registered:
            poller.register(sock, zmq.POLLIN)
            registered.add(sock)
        asked[request_id] = (sock, node_id)
        return True

    def _read(self, load: Load, sockets: dict, poller: zmq.Poller) -> memoryview | None:
        """The chunk's bytes from the first replica to answer well; None: trio's path, please."""
        asked: dict[int, tuple[zmq.Socket, int]] = {}  # request id -> (its socket, its node): not answered yet
        order = list(load.order)
        registered: set = set()
        deadline = time.monotonic() + self.read_timeout

        def ask_next() -> None:
            while order and not self._send(order.pop(0), load, sockets, poller, asked, registered):
                pass

        try:
            ask_next()
            hedge_at = time.monotonic() + self.hedge_after_s
            while asked:
                now = time.monotonic()
                if now >= deadline or self._closing:
                    # nobody answered in time: those asked are suspect (trio's retry asks the others first)
                    self.mark([n for _, n in asked.values()], StripefsError(ErrorCode.TIMEOUT, "no reply to a thread read"))
                    return None
                if order and now >= hedge_at:
                    ask_next()  # the replica asked has not answered: the next is asked too, the first answer wins
                    hedge_at = now + self.hedge_after_s
                    continue
                wait = (min(deadline, hedge_at) if order else deadline) - now
                for sock, _ in poller.poll(max(1, int(min(wait, _POLL_STOP_S) * 1000))):
                    while asked:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        outcome = self._reply(frames, load, asked)
                        if outcome is None:
                            continue  # a late answer to an earlier job's hedge: dropped
                        if outcome is not False:
                            if asked:  # beaten by a hedge: asked last for a while (NodePool.note_slow)
                                self.mark([n for _, n in asked.values()], None)
                            return outcome
                        ask_next()  # an error or a corrupt copy: the next replica at once
            return None  # every replica failed: trio's path retries, follows a moved chunk, reports
        finally:
            for sock in registered:
                poller.unregister(sock)

    def _reply(self, frames, load: Load, asked: dict):
        """A received reply: the chunk's bytes (good), False (this replica failed), None (not ours)."""
        decoded = decode_reply(frames)
        if decoded is None:
            return None
        request_id, body = decoded
        held = asked.pop(request_id, None)
        if held is None:
            return None
        return self.checked(body, frames, load, held[1])

    def checked(self, body, frames, load: Load, node_id: int):
        """Node ``node_id``'s reply ``body`` (with ``frames``) to ``load``'s request: the chunk's bytes
        (good) or False (this replica failed: an error, a version not the key's, a corrupt payload)."""
        if isinstance(body, p.ErrorRsp):
            log.debug("thread read of chunk %s: node %d answered %s", load.request.chunk, node_id, body.message)
            return False
        if not isinstance(body, p.ReadChunkRsp) or len(frames) != 2:
            return False
        if load.exact and body.version != load.key[2]:
            return False  # a read hint's guess went out of date: not what its key says
        data = frames[1].buffer
        if xxhash.xxh3_64_intdigest(data) != body.xxh3:
            log.warning("chunk %s from node %d failed its checksum in transit; trying the next copy", load.request.chunk, node_id)
            return False
        return data

    def mark(self, node_ids: list[int], exc: StripefsError | None) -> None:
        def mark() -> None:
            for n in node_ids:
                if exc is None:
                    self.nodes.note_slow(n)
                else:
                    self.nodes.suspect(n, exc)

        try:
            self._token.run_sync_soon(worker_threads.logged_callback, mark)
        except trio.RunFinishedError:
            pass
