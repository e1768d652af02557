"""Per-handle read-ahead: sequential detection and a window that grows.

Each open file handle (on the no-open mount: each inode) has a ``ReadStream``.
A read is *sequential* when it continues the stream: it starts where one of
the last few reads ended, or ends where one of them started (it fills the gap
the kernel left: its own read-ahead sends 1 MiB requests, several at once and
not always in order), or it is the stream's first read at offset 0. Each time
a sequential reader enters a new chunk the window doubles, from one chunk up
to the configured maximum. A read that continues nothing but starts within
``NEAR_BYTES`` of the stream's front keeps an open window (the kernel's
out-of-order requests: every other one continues nothing yet); a second such
read in a row, or any read farther away, is random and closes the window:
random readers never keep read-ahead going. The window's chunks are fetched
in parallel from the stripe's nodes into the chunk cache
(client/striping.py), and never more than a quarter of the cache's budget.

Why not "near" alone (as before issue 35's fifth round): every read of a file
under ``NEAR_BYTES`` was near, so random reads of small files read ahead on
every request; in the data-path model tester 69% of the replicated chunks
fetched ahead and most of the EC fragments were never read
(bench/model_ec_cpu.py ``readahead:``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: a read starting this close to the stream's front keeps an open window (out-of-order requests)
NEAR_BYTES = 4 << 20
#: reads remembered for "continues the stream": interleaved sequential readers of one handle
#: (threads, or processes on the no-open mount's per-inode stream) each continue their own
RECENT = 8


@dataclass
class ReadStream:
    next_offset: int = 0  # the stream's front: the end of its furthest read
    window: int = 0  # chunks to keep fetched ahead; 0: not sequential
    _chunk: int = -1  # the chunk the last read ended in
    _recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # (start, end) of the last reads
    _strays: int = 0  # reads in a row that continued nothing

    def advance(self, offset: int, end: int, chunk_size: int, max_window: int) -> int:
        """Record a read of [offset, end); the number of chunks to have fetched ahead of it."""
        recent = self._recent
        continues = (not recent and offset == 0) or any(offset == e or end == s for s, e in recent)
        recent.append((offset, end))
        near = abs(offset - self.next_offset) <= max(NEAR_BYTES, chunk_size)
        if continues:
            self._strays = 0
        else:
            self._strays += 1
            if not near or self._strays > 1 or not self.window:
                self.next_offset = end
                self.window, self._chunk = 0, -1
                return 0
        self.next_offset = max(self.next_offset, end) if near else end
        chunk = (end - 1) // chunk_size
        if chunk != self._chunk:
            self._chunk = chunk
            self.window = min(max_window, max(1, self.window * 2))
        return self.window
