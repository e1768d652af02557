"""Per-handle read-ahead: sequential detection and a window that grows.

Each open file handle has a ``ReadStream``. A read that starts near where the
previous one ended (the kernel's own read-ahead sends 1 MiB requests, several
at once and not always in order, so "near" is within ``NEAR_BYTES``) is
sequential; each time a sequential reader enters a new chunk the window
doubles, from one chunk up to the configured maximum. Any other read is random
and closes the window: random readers never trigger read-ahead. The window's
chunks are fetched in parallel from the stripe's nodes into the chunk cache
(client/striping.py), and never more than a quarter of the cache's budget.
"""

from __future__ import annotations

from dataclasses import dataclass

#: a read starting this close to the previous read's end still counts as sequential
NEAR_BYTES = 4 << 20


@dataclass
class ReadStream:
    next_offset: int = 0  # where a sequential reader reads next
    window: int = 0  # chunks to keep fetched ahead; 0: not sequential
    _chunk: int = -1  # the chunk the last read ended in

    def advance(self, offset: int, end: int, chunk_size: int, max_window: int) -> int:
        """Record a read of [offset, end); the number of chunks to have fetched ahead of it."""
        sequential = abs(offset - self.next_offset) <= max(NEAR_BYTES, chunk_size)
        self.next_offset = max(self.next_offset, end) if sequential else end
        if not sequential:
            self.window, self._chunk = 0, -1
            return 0
        chunk = (end - 1) // chunk_size
        if chunk != self._chunk:
            self._chunk = chunk
            self.window = min(max_window, max(1, self.window * 2))
        return self.window
