"""Log lines that come in floods, at most one per key per interval; the rest counted.

A storage node down on a cluster with no spare node makes every stripe a mount
writes degraded, and every commit of one a line in the daemon's log: tens a
second, the same words, each costing the process a formatted record and a
write. ``LogEvery`` lets the first line of a kind (its ``key``) through, holds
back the ones that follow within ``every_s`` and counts them, and tells that
count with the next line it lets through ("... (and 57 more like it in the last
10 s)"). A flood that stops leaves its last count untold: the line before it
says the thing is happening, which is what an operator needs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Hashable

#: keys remembered at most (forgotten all at once past it: bounded like everything else)
MAX_KEYS = 10_000


class LogEvery:
    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self.logger = logger
        self.every_s = every_s
        self._lock = threading.Lock()  # a daemon's transactions log from worker threads too
        self._last: dict[Hashable, tuple[float, int]] = {}  # key -> (when last logged, lines held back since)

    def log(self, level: int, key: Hashable, msg: str, *args) -> bool:
        """``logger.log(level, msg, *args)`` unless a line of ``key`` went within ``every_s``
        (then it is counted); True if it was logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = time.monotonic()
        with self._lock:
            last, held = self._last.get(key, (-math.inf, 0))
            if now - last < self.every_s:
                self._last[key] = (last, held + 1)
                return False
            if len(self._last) >= MAX_KEYS:
                self._last.clear()
            self._last[key] = (now, 0)
        if held:
            msg += " (and %d more like it in the last %.0f s)"
            args = (*args, held, now - last)
        self.logger.log(level, msg, *args)
        return True
