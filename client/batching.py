"""What the mount's two batching senders share: asynchronous creates and unlinks
(client/async_dirops.py) and small files written back after close (client/write_back.py).

Each queues what the kernel was already answered for and sends it in batches: a flusher
task wakes when the first item is queued, waits ``delay`` seconds (or less, once a batch is
full), and sends everything queued then (``FlushTimer``). Each counts its queued items per
directory, so that a request naming a directory can send what waits in it first
(``count_down``).
"""

from __future__ import annotations

from typing import Awaitable, Callable

import trio


class FlushTimer:
    """When a batching sender's flusher sends. ``queued`` is called in trio."""

    def __init__(self) -> None:
        self._wake = trio.Event()
        self._full = trio.Event()

    def queued(self, *, first: bool, full: bool) -> None:
        """An item was queued: the first one (the delay starts), or the one that fills a batch (no wait)."""
        if first:
            self._wake.set()
        if full:
            self._full.set()

    async def run(self, flush: Callable[[], Awaitable[None]], delay: Callable[[], float]) -> None:
        """Forever: ``flush()`` ``delay()`` seconds after the first item, or as soon as a batch is full.
        (``delay`` is asked each time: the tests stop the timer by patching the module's DELAY_S.)"""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            with trio.move_on_after(delay()):
                await self._full.wait()
            self._full = trio.Event()
            await flush()


def count_down(counts: dict[int, int], key: int) -> None:
    """One item of ``key`` fewer; the key goes with its last."""
    left = counts.get(key, 1) - 1
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)
