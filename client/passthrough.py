"""FUSE passthrough from the local disk cache (issue 29; docs/design.md "Passthrough from the disk cache").

On a mount run as root with ``-o passthrough`` and a ``disk_cache_dir``, an OPEN for reading of a
file whose current version sits whole in the disk cache is answered with FOPEN_PASSTHROUGH and a
backing id: the kernel then reads (and maps) that open file from the local disk itself, with no
READ request to the mount, its page cache that of the backing file.

What this module keeps, and why:

* **backing ids by version** (:class:`~.disk_cache.WholeKey`: inode, size, chunk-map digest). An id
  is registered (``FUSE_DEV_IOC_BACKING_OPEN``) once its whole file has passed its size and checksum
  check (:meth:`DiskCache.open_whole`, in a worker thread: the slow path of an OPEN), and kept,
  so that every later open of that version is answered on the reader thread from this map, with no
  ioctl and no disk I/O. The kernel holds its own reference to the backing file for each open file,
  so closing an id never disturbs an open file.
* **currency**: the open computes the key from the open information the mount's consistency rules
  already hold true at that open (a fresh LOOKUP's, a callback's, an OpenReq's): a file changed
  anywhere has new chunk versions or another size, hence another key, so an old backing file is
  never named again. The old version's id is retired when the feed reports the change
  (:meth:`forget_inodes`), when a newer version of the file is registered, and when the disk cache
  drops the entry (eviction, replacement, damage).
* **retiring, not closing at once**: the kernel looks the id up when the opener wakes, after the
  reply is written; an id closed in between would fail that open (EIO). A retired id is closed
  ``RETIRE_S`` later (:meth:`run`), and nothing new is answered with it meanwhile.
* **assembly**: a file opened for reading that is eligible but has no whole form yet is answered
  the normal way, and its whole form is written in the background from the normal read path
  (memory cache, chunk entries of the disk cache, storage nodes), pinned to the open's chunk map:
  the next open of that version passes through.
* at most ``MAX_IDS`` ids are registered (the least recently used are retired); at unmount the
  kernel frees every id of the connection with it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import trio

from .disk_cache import DiskCache, WholeKey, content_key
from .open_files import OpenFile

log = logging.getLogger(__name__)

#: largest file given a whole-file form: it is assembled in memory before it is written
WHOLE_MAX = 64 << 20
#: most backing ids registered at once (each pins one open file in the kernel)
MAX_IDS = 65536
#: seconds between an id's retirement and its BACKING_CLOSE (an opener answered with it has woken by then)
RETIRE_S = 2.0
#: whole files assembled at once
ASSEMBLE_PARALLEL = 2
#: most whole files waiting to be assembled (an epoch's first pass opens every file: beyond this the
#: open is answered the normal way and asks again at the file's next open)
ASSEMBLE_QUEUE = 1024


class Passthrough:
    """Backing ids of whole files in ``disk``, registered on ``device`` (set once INIT accepted
    PASSTHROUGH). Thread-safe: the reader thread asks :meth:`backing_id`, trio registers and
    assembles, the disk cache's worker threads report drops."""

    def __init__(self, disk: DiskCache, data):
        self.disk = disk
        self.data = data  # striping.DataPath: the normal read path, for assembly
        self.device = None  # client.fuse.device.Device, once the kernel accepted PASSTHROUGH
        self.token: trio.lowlevel.TrioToken | None = None
        self.nursery: trio.Nursery | None = None
        self._ids: OrderedDict[WholeKey, int] = OrderedDict()  # least recently used first
        self._by_ino: dict[int, WholeKey] = {}
        self._retired: list[tuple[float, int]] = []
        self._assembling: set[WholeKey] = set()
        self._lock = threading.Lock()
        self._limit = trio.CapacityLimiter(ASSEMBLE_PARALLEL)
        self.limit_size = min(WHOLE_MAX, disk.capacity // 8)
        # counters (tests, bench, the unmount's log line)
        self.opens = 0  # opens answered with a backing id
        self.registered = 0
        self.rejected = 0  # whole files that failed their check (the open went the normal way)
        self.assembled = 0
        disk.on_whole_dropped = self._dropped

    @property
    def active(self) -> bool:
        return self.device is not None

    # -- on an OPEN (any thread, no I/O) ---------------------------------------------------------

    def key_of(self, of: OpenFile, known: tuple | None = None) -> WholeKey | None:
        """The whole-file key of ``of``'s committed version, or None if it may not pass through: too
        small or large, or this mount holds bytes of it not committed (a write session).
        ``known``: (an OpenRsp's attributes, :meth:`key_of_info` of it), reused when ``of`` holds
        that very answer (``of.attr is`` its attributes: its chunk map came with them)."""
        size = of.attr.size
        if not 0 < size <= self.limit_size or of.size != size or of.dirty or of.uncommitted \
                or of.inflight or of.write_error is not None:
            return None
        if known is not None and of.attr is known[0]:
            return known[1]
        return content_key(of.ino, size, of.chunks)

    def key_of_info(self, rsp) -> WholeKey | None:
        """The key of an OpenRsp's version (before the open records it), or None if ineligible."""
        size = rsp.attr.size
        if not 0 < size <= self.limit_size:
            return None
        return content_key(rsp.attr.ino, size, rsp.chunks)

    def backing_id(self, key: WholeKey | None) -> int:
        """The registered id of this version, or 0."""
        if key is None or self.device is None:
            return 0
        with self._lock:
            bid = self._ids.get(key, 0)
            if bid:
                self._ids.move_to_end(key)
        return bid

    def needs_registering(self, key: WholeKey | None) -> bool:
        """Whether an open of this version should take the slow path: its whole form is on disk
        but not registered yet (the check reads the file: not on the reader thread)."""
        return key is not None and self.device is not None and key not in self._ids and self.disk.has_whole(key)

    def want(self, key: WholeKey | None, of: OpenFile) -> None:
        """An open of an eligible version with no whole form: write it in the background (any thread)."""
        if key is None or self.device is None or self.token is None or self.disk.has_whole(key):
            return
        with self._lock:
            if key in self._assembling or len(self._assembling) >= ASSEMBLE_QUEUE:
                return
            self._assembling.add(key)
        snapshot = OpenFile(of.ino, of.attr, of.layout, dict(of.chunks))  # pinned to this version
        try:
            self.token.run_sync_soon(self._start_assembly, key, snapshot)
        except trio.RunFinishedError:
            with self._lock:
                self._assembling.discard(key)

    # -- registering (trio) ------------------------------------------------------------------------

    async def register(self, key: WholeKey | None) -> int:
        """The id of this version, registering its whole file if it is on disk and checks out; 0 if not."""
        bid = self.backing_id(key)
        if bid or not self.needs_registering(key):
            return bid
        return await trio.to_thread.run_sync(self._register, key)

    def _register(self, key: WholeKey) -> int:
        fd = self.disk.open_whole(key)
        if fd is None:
            self.rejected += 1
            return 0
        try:
            bid = self.device.backing_open(fd)
        except OSError as exc:
            log.warning("passthrough: the kernel refused the backing file of inode %d (%s): read the normal way",
                        key.ino, exc)
            self.rejected += 1
            return 0
        finally:
            os.close(fd)
        with self._lock:
            old = self._ids.get(key)
            if old:  # registered meanwhile by another open: keep that one
                self._retire_locked(bid)
                return old
            stale = self._by_ino.get(key.ino)
            if stale is not None and stale != key:
                self._retire_locked(self._ids.pop(stale, 0))
            self._ids[key] = bid
            self._by_ino[key.ino] = key
            while len(self._ids) > MAX_IDS:
                lru, lru_id = self._ids.popitem(last=False)
                if self._by_ino.get(lru.ino) == lru:
                    del self._by_ino[lru.ino]
                self._retire_locked(lru_id)
        self.registered += 1
        return bid

    def _start_assembly(self, key: WholeKey, snapshot: OpenFile) -> None:
        try:
            self.nursery.start_soon(self._assemble, key, snapshot, name=f"whole-file-{key.ino}")
        except RuntimeError:  # the mount is stopping
            with self._lock:
                self._assembling.discard(key)

    async def _assemble(self, key: WholeKey, snapshot: OpenFile) -> None:
        try:
            async with self._limit:
                if self.disk.has_whole(key):
                    return
                data = await self.data.read(snapshot, 0, key.size)
                if len(data) != key.size:
                    log.warning("passthrough: inode %d read %d of %d bytes; no whole file", key.ino, len(data), key.size)
                    return
                if await trio.to_thread.run_sync(self.disk.put_whole, key, data):
                    self.assembled += 1
        except Exception as exc:  # a failed read: the file is simply not passed through
            log.info("passthrough: no whole file for inode %d: %s", key.ino, exc)
        finally:
            with self._lock:
                self._assembling.discard(key)

    # -- retiring --------------------------------------------------------------------------------

    def forget_inodes(self, inodes) -> None:
        """The feed says these inodes changed (None: anything may have): their ids are retired."""
        with self._lock:
            keys = list(self._by_ino.values()) if inodes is None else \
                [k for k in map(self._by_ino.get, inodes) if k is not None]
            for key in keys:
                self._unregister_locked(key)

    def _dropped(self, key: WholeKey) -> None:
        with self._lock:
            self._unregister_locked(key)

    def _unregister_locked(self, key: WholeKey) -> None:
        bid = self._ids.pop(key, 0)
        if self._by_ino.get(key.ino) == key:
            del self._by_ino[key.ino]
        if bid:
            self._retire_locked(bid)

    def _retire_locked(self, bid: int) -> None:
        if bid:
            self._retired.append((time.monotonic(), bid))

    def close_retired(self, now: float | None = None, grace: float = RETIRE_S) -> int:
        """BACKING_CLOSE every id retired ``grace`` seconds ago or more; how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [bid for t, bid in self._retired if now - t >= grace]
            self._retired = [(t, bid) for t, bid in self._retired if now - t < grace]
        for bid in due:
            try:
                self.device.backing_close(bid)
            except OSError as exc:  # the connection is gone, or the id was never ours
                log.debug("passthrough: BACKING_CLOSE %d: %s", bid, exc)
        return len(due)

    async def run(self) -> None:
        """Close retired ids (a task of the mount's nursery)."""
        while True:
            await trio.sleep(RETIRE_S / 2)
            if self._retired and self.device is not None:
                await trio.to_thread.run_sync(self.close_retired)

    def stats(self) -> dict[str, int]:
        return {"opens": self.opens, "registered": self.registered, "rejected": self.rejected,
                "assembled": self.assembled, "ids": len(self._ids)}
