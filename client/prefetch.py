"""Sampler-order prefetch: fetch the files a training job will read next.

A DataLoader's sampler knows this epoch's order. ``stripefs.torch.PrefetchSampler``
hands the upcoming paths to the mount (``setxattr(DIR, "user.stripefs.prefetch",
b"\\n".join(paths))``, paths relative to DIR), and this module fetches them ahead
of the readers, a few at a time, for all DataLoader workers at once:

1. resolve a batch of paths with one ``LookupPathsReq`` (no per-file lookups);
2. read each file whole: small replicated files 16 at a time from one node in
   one ``ReadChunksReq`` (``DataPath.fetch`` with a node: into the chunk cache;
   its loads registered there as in flight, ``ChunkCache.claim``, so a READ of one
   of its files meanwhile waits for the batch rather than loading it again),
   anything else, and any read of a batch that fails, through ``DataPath.read``
   (replica failover, every layout); ``parallel`` requests in flight;
3. push the bytes into the kernel's page cache (``notify_store``, client/fuse_backend.py) when
   the kernel knows the inode (a dataset that was listed, as ImageFolder does),
   so the worker's open+read is answered by the kernel alone (the open keeps
   the page cache: ``Operations.prefetched``), and the chunk cache lets the
   file's chunks go (``ChunkCache.release``: a second copy would only be memory,
   which libzmq then cannot reuse for the next reply). Otherwise the bytes wait
   in the chunk cache, where the read finds them. The push is one plain thread's
   (:class:`_Pusher`): a batch is handed to it the moment its reply lands, with
   no turn of the trio thread between, and it pushes in landing order; what the
   mount learns from it (``stored``, ``on_fetched``) goes back to trio after.

A later epoch announces the same files again: one whose pushed version the
kernel still holds is skipped (``kept``), from what the mount knows when it can
(``path_in_page_cache``, in ``submit``: no LookupPathsReq), else once resolved
(``in_page_cache``). Step 1 also asks the mount first (``known_open_info``): after
the tree scan a listing kept every file's open information, so a cold epoch
sends no LookupPathsReq either.

Bounds: the queue holds at most ``max_queued`` paths (older ones are dropped:
the readers are past them); files above ``max_file_bytes`` are left to the
sequential read-ahead; the chunk cache's byte budget bounds memory. A prefetch
that fails (file deleted, node down) is dropped quietly: the read will retry
and report.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections import deque
from typing import Awaitable, Callable

import trio

from ..common import protocol as p
from ..common.errors import StripefsError
from ..common.layout import one_chunk
from ..common.thread_names import name_os_thread
from . import fuse_backend, metrics
from .fetch import Fetch
from .kernel_cache import KernelCache
from .meta_rpc import MetaClient
from .open_files import OpenFile
from .shm_cache import ShmCache
from .striping import DataPath
from .worker_threads import logged_callback

log = logging.getLogger(__name__)

#: paths resolved per LookupPathsReq
RESOLVE_BATCH = 256
#: small files read from one node in one ReadChunksReq
FETCH_BATCH = 16


class Prefetcher:
    def __init__(
        self,
        meta: MetaClient,
        data: DataPath,
        kcache: KernelCache,
        *,
        parallel: int = 16,
        max_queued: int = 16384,
        max_file_bytes: int = 16 << 20,
    ):
        self.meta = meta
        self.data = data
        self.kcache = kcache
        self.parallel = parallel
        self.max_file_bytes = max_file_bytes
        # (root, shm, path); shm: the announcer's uid when the file also goes to shared memory, else None
        self._queue: deque[tuple[int, int | None, bytes]] = deque(maxlen=max_queued)
        self._wake = trio.Event()
        self.on_fetched: Callable[[p.OpenRsp, bool], None] = lambda rsp, stored: None
        #: before a batch of paths is resolved: what the mount wrote and has not committed yet goes
        #: (closes that send nothing: a file just written is read as written, not as last committed)
        self.before_resolve: Callable[[], Awaitable[None]] = _nothing
        # whether the kernel holds this version's pages already (Operations.in_page_cache): a
        # later epoch's announcement of a file still warm costs no fetch and no store
        self.in_page_cache: Callable[[p.OpenRsp], bool] = lambda rsp: False
        # the same for a path (root inode, path), from what the mount knows without asking the
        # daemon (Operations.path_in_page_cache): such a path is not even resolved
        self.path_in_page_cache: Callable[[int, bytes], bool] = lambda root, path: False
        # a path's open information the mount keeps true (Operations.known_open_info): what a
        # LookupPathsReq would answer, without asking (a cold epoch after the tree scan's listings)
        self.known_open_info: Callable[[int, bytes], p.OpenRsp | None] = lambda root, path: None
        self.shm: ShmCache | None = None  # set by the mount when it has a shared-memory directory
        self.fetched = 0  # files fetched
        self.stored = 0  # of those, pushed into the page cache
        self.failed = 0
        self.kept = 0  # files whose copy of that version was still there (shared memory, or the page cache)
        self._busy = 0  # paths taken from the queue and not yet done with (resolving, fetching, storing)
        self._pusher: _Pusher | None = None  # while ``run`` runs

    def report(self) -> str:
        """What ``getfattr -n user.stripefs.prefetch MOUNT`` shows."""
        return (f"pending={len(self._queue) + self._busy} fetched={self.fetched} stored={self.stored} "
                f"failed={self.failed} kept={self.kept}")

    def submit(self, root: int, blob: bytes, *, shm: bool = False, user: int = 0) -> None:
        """Queue newline-separated paths relative to directory inode ``root`` (from setxattr).

        ``shm``: also put them in the shared-memory directory (client/shm_cache.py), charged to
        ``user`` (the announcer's uid: each user has a fair share of its budget).
        """
        shm = user if shm and self.shm is not None else None
        for path in blob.split(b"\n"):
            if path.strip(b"/"):
                if shm is None and self.path_in_page_cache(root, path):
                    self.kept += 1  # a later epoch: the kernel holds this version still
                    continue
                self._queue.append((root, shm, path))
        self._wake.set()

    async def run(self) -> None:
        slots = trio.Semaphore(self.parallel)
        pusher = self._pusher = _Pusher(self, trio.lowlevel.current_trio_token(), limit=self.parallel * 4)
        try:
            async with trio.open_nursery() as nursery:
                await self._run(nursery, slots, pusher)
        finally:
            pusher.stop()
            self._pusher = None

    async def _run(self, nursery: trio.Nursery, slots: trio.Semaphore, pusher: _Pusher) -> None:
        while True:
            while not self._queue:
                self._wake = trio.Event()
                await self._wake.wait()
            root, shm = self._queue[0][:2]
            batch = []
            while self._queue and len(batch) < RESOLVE_BATCH and self._queue[0][:2] == (root, shm):
                batch.append(self._queue.popleft()[2])
            self._busy += len(batch)
            await self.before_resolve()
            stamp = self.kcache.stamp()  # a change after this makes what we fetch unfit for the page cache
            files: list[p.OpenRsp | None] = []
            unknown = batch
            if shm is None:  # (a shared-memory copy's name carries the daemon's version: resolved)
                unknown = []
                for path in batch:
                    info = self.known_open_info(root, path)
                    if info is None:
                        unknown.append(path)
                    else:
                        files.append(info)
            if unknown:
                try:
                    rsp = await self.meta.call(p.LookupPathsReq(root=root, paths=unknown), retry=False)
                    files += rsp.files
                except StripefsError as exc:
                    log.info("prefetch: cannot resolve %d path(s): %s", len(unknown), exc)
                    self._busy -= len(unknown)
            by_node: dict[int, list[p.OpenRsp]] = {}
            for info in files:
                if info is None or not 0 < info.attr.size <= self.max_file_bytes:
                    self._busy -= 1
                    continue
                if (self.in_page_cache(info) if shm is None
                        else self.shm.has(info.attr.ino, info.attr.mtime_ns, info.attr.size)):
                    self.kept += 1  # a later epoch: the kernel, or read_file, has that version still
                    self._busy -= 1
                    self.on_fetched(info, False)
                    continue
                node = self._batchable(info)
                if node is not None:  # a small replicated file: with others from the same node
                    by_node.setdefault(node, []).append(info)
                    continue
                await slots.acquire()  # back-pressure: at most `parallel` requests in flight
                nursery.start_soon(self._fetch, info, shm, stamp, slots, pusher, name=f"prefetch-{info.attr.ino}")
            for node, infos in by_node.items():
                for i in range(0, len(infos), FETCH_BATCH):
                    await slots.acquire()
                    nursery.start_soon(
                        self._fetch_batch, node, infos[i : i + FETCH_BATCH], shm, stamp, slots, pusher,
                        name=f"prefetch-batch-{node}",
                    )

    def _batchable(self, info: p.OpenRsp) -> int | None:
        """The node to read a one-chunk replicated file from in a batch (None: read it alone)."""
        ref = one_chunk(info)
        if ref is None or not ref.nodes or len(info.chunks) != 1 or not info.layout.redundancy.startswith("replicas"):
            return None
        if (info.attr.ino, 0, ref.version) in self.data.cache:
            return None  # cached already: the single path answers it without the network
        self.data.nodes.learn(info.nodes)
        order = self.data.nodes.order(ref.nodes, start=info.attr.ino)
        return None if self.data.nodes.is_suspect(order[0]) else order[0]

    async def _fetch_batch(
        self, node: int, infos: list[p.OpenRsp], shm: int | None, stamp: int, slots: trio.Semaphore, fetched: _Pusher
    ) -> None:
        """Whole small files from one node in one request; any that fails goes the single way (failover)."""
        retry = infos
        try:
            results = await self.data.fetch([Fetch.small_file(i) for i in infos], node=node)
            landed = time.perf_counter()
            retry, files = [], []
            for info, result in zip(infos, results):
                if isinstance(result, StripefsError):
                    retry.append(info)
                    continue
                self.fetched += 1
                files.append((info, shm, stamp, result[: info.attr.size], landed))
            if files:
                fetched.put(files)  # to the pushing thread now: no checkpoint between the reply and this
                await fetched.room()  # back-pressure (holding the slot) while it is behind
        finally:
            slots.release()
        for info in retry:  # rare: a copy gone, stale or corrupt; the single path fails over to other copies
            await slots.acquire()
            await self._fetch(info, shm, stamp, slots, fetched)

    async def _fetch(self, info: p.OpenRsp, shm: int | None, stamp: int, slots: trio.Semaphore, fetched: _Pusher) -> None:
        try:
            self.data.nodes.learn(info.nodes)
            of = OpenFile(info.attr.ino, info.attr, info.layout, {c.index: c for c in info.chunks})
            try:
                data = await self.data.read(of, 0, info.attr.size)
            except Exception as exc:  # a prefetch never takes the mount down; the read will retry and report
                self.failed += 1
                self._busy -= 1
                log.log(logging.DEBUG if isinstance(exc, StripefsError) else logging.WARNING,
                        "prefetch of inode %d failed: %s", info.attr.ino, exc)
                return
            self.fetched += 1
            fetched.put([(info, shm, stamp, data, time.perf_counter())])  # the pushing thread is done with it after
            await fetched.room()
        finally:
            slots.release()

    def _pushed(self, files: list, stored: set[int]) -> None:
        """(trio thread) ``files`` were pushed (the inodes in ``stored``) or left to their reads.

        The kernel holds every byte of the pushed ones now: the chunk cache lets them go (libzmq's
        fresh pages: ChunkCache.release), as a cold READ that gave the kernel a whole chunk does. Not
        on the pushing thread right after its push: a READ the kernel sent before the pages were
        there (a worker got to the file first) may still wait in the device or in the reader's
        hands, and finds the bytes here in the time this report takes to reach the trio thread
        (released at once, 0.000-0.051 READs a sample went to a node for them in 6 runs; 0.000-0.009
        so in 3: docs/design.md, "The prefetched cold epoch's push")."""
        self.data.cache.release([(info.attr.ino, c.index, c.version) for info, *_ in files
                                 if info.attr.ino in stored for c in info.chunks])
        self.stored += len(stored)
        for info, *_ in files:
            self.on_fetched(info, info.attr.ino in stored)
        self._busy -= len(files)


class _Pusher:
    """The thread that pushes fetched files into the page cache (module docstring, step 3).

    Measured before it (docs/design.md, "The prefetched cold epoch", sixth pass): a trio task took
    the fetched files from a channel and pushed them in a trio worker thread, one hop at a time; a
    file waited 12-107 ms from its batch's reply to its push (3 runs; in one at load 6, 21-40 ms, of
    it 15-30 ms for the hop before to come back and for the trio thread to take the next), while the DataLoader's workers, reading
    a sample every ~0.4 ms, reached files fetched and not pushed (a READ to the mount each). Here a
    batch goes to a queue the moment it lands (``put``, on the trio thread, no checkpoint between),
    and this thread pushes whatever is queued in landing order, each landed batch under
    ``kernel_lock`` (``_store``: a file changed since its prefetch began is never pushed). What the
    mount learns from it (``Prefetcher._pushed``: ``stored``, ``on_fetched``, ``_busy``, and the
    pushed files' chunks let go) goes back to the trio thread, once for whatever was pushed in one
    turn (``run_sync_soon``); the thread never waits for it.

    Bounds: ``room`` makes the fetching task wait (holding its slot) while more than ``limit``
    files are handed over and not yet reported back, as the channel before did.
    """

    def __init__(self, owner: Prefetcher, token: trio.lowlevel.TrioToken, *, limit: int):
        self._owner = owner
        self._token = token
        self._limit = limit
        self._jobs: queue.SimpleQueue[list | None] = queue.SimpleQueue()
        self._handed = 0  # files put and not yet reported back (trio thread)
        self._room = trio.Event()
        self._thread = threading.Thread(target=self._run, name="prefetch-push", daemon=True)
        self._thread.start()

    def put(self, files: list) -> None:
        """(trio thread) Push ``files`` ((info, shm, stamp, data, landed) each) as soon as the thread can."""
        self._handed += len(files)
        self._jobs.put(files)

    async def room(self) -> None:
        """(trio thread) Wait while more than ``limit`` files are handed over and not reported back."""
        while self._handed > self._limit:
            await self._room.wait()

    def stop(self) -> None:
        """(trio thread) The thread ends after what is queued (it does not wait for it: pushes are
        a few hundred microseconds each, and with no session they fail at once)."""
        self._jobs.put(None)

    def _done(self, files: list, stored: set[int]) -> None:
        """(trio thread) A turn's report."""
        self._handed -= len(files)
        self._room.set()  # every waiter looks again
        self._room = trio.Event()
        self._owner._pushed(files, stored)

    def _run(self) -> None:
        name_os_thread()
        owner = self._owner
        while True:
            jobs = [self._jobs.get()]
            while jobs[-1] is not None:  # whatever else landed meanwhile: one report for the turn
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            stop = jobs[-1] is None
            files: list = []
            stored: set[int] = set()
            for job in jobs:
                if job is None:
                    continue
                try:
                    took = time.perf_counter()
                    known = [(info, stamp, data, landed) for info, _, stamp, data, landed in job
                             if owner.kcache.knows(info.attr.ino)]
                    shared = [(info, data, shm) for info, shm, _, data, _ in job if shm is not None]
                    stored.update(_store(known, shared, owner.shm, owner.kcache, took) if known or shared else ())
                except Exception:  # noqa: BLE001 - a bug: the files are left to their reads, the thread goes on
                    log.exception("prefetch: pushing %d file(s) failed", len(job))
                files += job
            if files:
                try:
                    self._token.run_sync_soon(logged_callback, self._done, files, stored)
                except trio.RunFinishedError:
                    return  # the mount's trio run is over: nobody to tell
            if stop:
                return


def _store(files: list, shared: list, shm: ShmCache | None, kcache: KernelCache, took: float) -> list[int]:
    """notify_store each file whole (the inodes that made it); copy ``shared`` to shm. On the pushing thread.

    A file that changed since its prefetch began is not pushed: under ``kernel_lock``
    a push either sees the change noted, or happens before the change's invalidation.
    Shared-memory copies need no such care: their names carry the version.
    """
    began = time.perf_counter()
    for info, data, user in shared:
        shm.put(info, data, user)
    stored = []
    waits = [0.0, 0.0, 0.0]  # landed_to_thread, thread_to_push, push (metrics.PREFETCH_PUSH_SECONDS)
    with kcache.kernel_lock:
        for info, stamp, data, landed in files:
            if kcache.changed_since(stamp, info.attr.ino):
                continue
            try:
                start = time.perf_counter()
                fuse_backend.notify_store(info.attr.ino, 0, data)
                stored.append(info.attr.ino)
                end = time.perf_counter()
                waits[0] += took - landed
                waits[1] += start - took
                waits[2] += end - start
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # ENOENT: the kernel forgot the inode meanwhile
                    log.debug("prefetch: cannot store inode %d in the page cache: %s", info.attr.ino, exc)
    if files:
        metrics.PREFETCH_PUSH.labels("hops").inc()
    if stored:
        metrics.PREFETCH_PUSH.labels("files").inc(len(stored))
        for stage, seconds in zip(("landed_to_thread", "thread_to_push", "push"), waits):
            metrics.PREFETCH_PUSH_SECONDS.labels(stage).inc(seconds)
    return stored


async def _nothing() -> None:
    pass
