"""The client's memory cache of chunk data, with a byte budget.

Keyed by (ino, index, version): a committed write makes a new version, so a
stale entry can never be returned for a newer version; it just ages out of the
LRU. ``fetch`` deduplicates concurrent misses: many readers of one chunk (the
kernel's parallel read-ahead requests, a prefetch task) share one network read.

A version is not yet final while its write session is open: the mount rewrites
an uncommitted chunk (or EC stripe) at the same version, and every such change
calls ``drop_inode`` (each send to the nodes; a write buffered in the mount
changes nothing stored yet). The EC path then puts back what it wrote
(write-through, client/ec_path.py). A load that was already in flight then may bring back the
bytes from before the change, under the same key. So ``drop_inode`` also marks
the inode's loads in flight as stale: their result is handed to the task that
started them (its read began before the change) but never stored, and tasks
waiting for it load again.

Threads: the cache is trio's, and also the cold-read workers' (client/thread_reads.py), which
store what they loaded (``keep``) and touch what the reader thread answered from it (``touch``)
themselves rather than through a callback on the trio thread (a wake-up of the event loop per
cold READ). So every method that changes the cache takes ``_lock``, a plain lock held only for
dict work, never across an await or anything that waits; ``peek``, ``loading`` and ``in`` are
single dict lookups, atomic under the GIL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Awaitable, Callable

import trio

from . import metrics

log = logging.getLogger(__name__)

Key = tuple[int, int, int]  # (ino, index, version)


class ChunkCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._entries: OrderedDict[Key, bytes] = OrderedDict()
        self._inflight: dict[Key, trio.Event] = {}
        self._prefetched: set[Key] = set()  # prefetched, not read yet
        self._stale_loads: set[Key] = set()  # in flight across a drop_inode: not to be stored
        self._batch: set[Key] = set()  # loads of the prefetcher's batches in flight (claim / settle)
        self._by_ino: dict[int, set[Key]] = {}  # the cached keys of each inode (drop_inode without a scan)
        self._lock = threading.Lock()  # trio's thread and the cold-read workers (module docstring)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries or key in self._inflight

    def peek(self, key: Key) -> bytes | None:
        """(any thread) The bytes held for ``key``, without touching the LRU order or the accounting
        (client/thread_reads.py hands those to trio: ``get``). One dict lookup: atomic under the GIL."""
        return self._entries.get(key)

    def loading(self, key: Key) -> bool:
        """(any thread) A load of ``key`` is in flight."""
        return key in self._inflight

    def prefetching(self, key: Key) -> bool:
        """(any thread) The prefetcher's batch is fetching ``key`` now (metrics.PREFETCH_RACE)."""
        return key in self._batch

    def keep(self, key: Key, data: bytes, *, ahead: bool = False) -> bool:
        """(any thread) Store a chunk loaded outside ``fetch`` (client/thread_reads.py), unless it is
        held or a ``fetch`` of it is in flight (that load stores it); ``ahead``: fetched before any
        read asked (read-ahead accounting). True if stored. A committed version never changes, so
        storing it late is never wrong."""
        with self._lock:
            if key in self._entries or key in self._inflight:
                return False
            self._put(key, data)
            if ahead and key in self._entries:
                self._prefetched.add(key)
                metrics.READAHEAD.labels("fetched").inc()
            return True

    def touch(self, key: Key) -> bool:
        """(any thread) A read answered from ``key`` outside ``fetch``: its LRU place and read-ahead
        accounting, as ``get`` does; False if it is no longer held."""
        return self.get(key) is not None

    def get(self, key: Key) -> bytes | None:
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    metrics.READAHEAD.labels("used").inc()
            return data

    def put(self, key: Key, data: bytes) -> None:
        with self._lock:
            self._put(key, data)

    def _put(self, key: Key, data: bytes) -> None:
        if len(data) > self.budget:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used -= len(old)
        self._entries[key] = data
        self._by_ino.setdefault(key[0], set()).add(key)
        self.used += len(data)
        while self.used > self.budget:
            gone, evicted = self._entries.popitem(last=False)
            self._unindex(gone)
            self.used -= len(evicted)
            self._forget_prefetched(gone)

    def _unindex(self, key: Key) -> None:
        keys = self._by_ino[key[0]]
        keys.discard(key)
        if not keys:
            del self._by_ino[key[0]]

    def release(self, keys) -> int:
        """(any thread) Let go of ``keys`` held (a load in flight is left alone): the kernel's page
        cache holds their bytes now, so keeping them would only be memory, and memory kept is memory
        libzmq cannot reuse for the next reply (each then lands in fresh pages: docs/design.md,
        "Where a cold file's CPU goes"). Not a change of the chunk: nothing is marked stale. Returns
        how many were held."""
        released = 0
        with self._lock:
            for key in keys:
                data = self._entries.pop(key, None)
                if data is None:
                    continue
                released += 1
                self._unindex(key)
                self.used -= len(data)
                self._prefetched.discard(key)  # read or not: the kernel answers its reads now
        return released

    def drop_inode(self, ino: int, from_index: int = 0, until: int | None = None) -> None:
        """Forget every cached chunk of ``ino`` from ``from_index`` on (to ``until``, exclusive),
        and make the loads of those chunks in flight store nothing."""

        def dropped(key: Key) -> bool:
            return key[0] == ino and key[1] >= from_index and (until is None or key[1] < until)

        with self._lock:
            for key in [k for k in self._by_ino.get(ino, ()) if dropped(k)]:
                self._unindex(key)
                self.used -= len(self._entries.pop(key))
                self._forget_prefetched(key)
            if self._inflight:
                self._stale_loads.update(k for k in self._inflight if dropped(k))

    def drop_chunk(self, ino: int, index: int) -> None:
        """``drop_inode`` for one chunk (every version, every EC fragment)."""
        self.drop_inode(ino, index, index + 1)

    async def fetch(self, key: Key, load: Callable[[], Awaitable[bytes]], *, prefetch: bool = False) -> bytes:
        """The bytes for ``key``, loaded once however many tasks ask at the same time.

        If the load fails, the tasks that were waiting for it try again themselves.
        """
        while True:
            data = self.get(key)
            if data is not None:
                metrics.CACHE_HITS.inc()
                return data
            pending = self._inflight.get(key)
            if pending is None:
                break
            if key in self._batch:
                metrics.PREFETCH_RACE.labels("waited").inc()
            waited = time.perf_counter()
            await pending.wait()
            metrics.network_wait(time.perf_counter() - waited)
        metrics.CACHE_MISSES.inc()
        if key in self._batch:
            metrics.PREFETCH_RACE.labels("loaded_again").inc()
        done = self._inflight[key] = trio.Event()
        waited = time.perf_counter()
        try:
            data = await load()
            if key in self._stale_loads:
                return data  # loaded across a change of the chunk: good for this reader only
            with self._lock:
                self._put(key, data)
                if prefetch and key in self._entries:  # before any reader can see it: read-ahead accounting
                    self._prefetched.add(key)
                    metrics.READAHEAD.labels("fetched").inc()
            return data
        finally:
            metrics.network_wait(time.perf_counter() - waited)
            del self._inflight[key]
            self._stale_loads.discard(key)
            done.set()

    # -- the prefetcher's batches (client/prefetch.py, DataPath._fetch_from)

    def claim(self, keys) -> list[Key]:
        """(trio thread) Register the loads of a prefetcher's batch (one ReadChunksReq, sent outside
        ``fetch``) as loads in flight, so that a READ of one of its chunks meanwhile waits for the
        batch's bytes (``fetch``; the thread path sees ``loading`` and hands the READ to trio) rather
        than loading the chunk again from a node, which the push after would copy once more. Returns
        the keys registered (not held and not loading already); each must be ``settle``d."""
        claimed = []
        with self._lock:
            for key in keys:
                if key not in self._entries and key not in self._inflight:
                    self._inflight[key] = trio.Event()
                    self._batch.add(key)
                    claimed.append(key)
        return claimed

    def settle(self, key: Key, data) -> None:
        """(trio thread) A claimed load ended: ``data`` stored (None: it failed, or was cancelled) unless
        the chunk changed meanwhile (``drop_inode``: a stale version never serves), and the READs
        waiting for it woken: they find the bytes, or load the chunk themselves."""
        with self._lock:
            self._batch.discard(key)
            done = self._inflight.pop(key)
            stale = key in self._stale_loads
            self._stale_loads.discard(key)
            if data is not None and not stale:
                self._put(key, data)
        done.set()

    # -- read-ahead accounting (client.metrics): was a prefetched chunk ever read? --

    def _forget_prefetched(self, key: Key) -> None:
        if key in self._prefetched:
            self._prefetched.discard(key)
            metrics.READAHEAD.labels("wasted").inc()
