"""The client's memory cache of chunk data, with a byte budget.

Keyed by (ino, index, version): a committed write makes a new version, so a
stale entry can never be returned for a newer version; it just ages out of the
LRU. ``fetch`` deduplicates concurrent misses: many readers of one chunk (the
kernel's parallel read-ahead requests, a prefetch task) share one network read.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

Key = tuple[int, int, int]  # (ino, index, version)


class ChunkCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._entries: OrderedDict[Key, bytes] = OrderedDict()
        self._inflight: dict[Key, trio.Event] = {}
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._entries or key in self._inflight

    def get(self, key: Key) -> bytes | None:
        data = self._entries.get(key)
        if data is not None:
            self._entries.move_to_end(key)
        return data

    def put(self, key: Key, data: bytes) -> None:
        if len(data) > self.budget:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used -= len(old)
        self._entries[key] = data
        self.used += len(data)
        while self.used > self.budget:
            _, evicted = self._entries.popitem(last=False)
            self.used -= len(evicted)

    def drop_inode(self, ino: int, from_index: int = 0) -> None:
        """Forget every cached chunk of ``ino`` at or after ``from_index``."""
        for key in [k for k in self._entries if k[0] == ino and k[1] >= from_index]:
            self.used -= len(self._entries.pop(key))

    async def fetch(self, key: Key, load: Callable[[], Awaitable[bytes]]) -> bytes:
        """The bytes for ``key``, loaded once however many tasks ask at the same time.

        If the load fails, the tasks that were waiting for it try again themselves.
        """
        while True:
            data = self.get(key)
            if data is not None:
                self.hits += 1
                return data
            pending = self._inflight.get(key)
            if pending is None:
                break
            await pending.wait()
        self.misses += 1
        done = self._inflight[key] = trio.Event()
        try:
            data = await load()
            self.put(key, data)
            return data
        finally:
            del self._inflight[key]
            done.set()
