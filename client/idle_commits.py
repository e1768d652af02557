"""Write sessions committed when the writing stops, not at close (docs/design.md, "A close
that sends nothing").

On the default mount of a daemon that grants callbacks the kernel is told never to send
FLUSH (its first one is answered ENOSYS, which holds for the whole connection), so a close
sends nothing and a warm read of a file is no request at all. The mount then commits each
write session itself: ``IDLE_S`` after the session's last WRITE (here), at fsync, at
unmount, and before it acknowledges another mount's change or read
(``Operations._before_ack``): the daemon makes every other mount's open or stat of a
file this mount writes wait for that acknowledgement (daemon/callbacks.py, write marks).

One task, one timer: ``touched`` (on the trio thread, per WRITE) moves the file to the end
of an ordered dict of deadlines, so the first entry is always the next one due. The timer
wakes at the first deadline and commits with it every session due within ``EARLY_S``, so a
session is committed between ``IDLE_S - EARLY_S`` and ``IDLE_S`` after its last WRITE (later
only when the trio thread is late), and files closed in a stream share a wake-up.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

#: how long after its last WRITE a write session is committed (a program writing a file in
#: pieces gets one commit; a close followed by an open elsewhere does not wait for it)
IDLE_S = 0.05
#: a session due within this of the one the timer woke for is committed with it, a little early: a
#: writer of many small files (``cp -r``: one every ~0.5 ms) made the timer wake once per file
EARLY_S = 0.01


class IdleCommits:
    def __init__(self, commit: Callable[[int], Awaitable[None]]) -> None:
        self.commit = commit  # Operations: commit what inode ``ino`` holds, if anything
        self._due: OrderedDict[int, float] = OrderedDict()  # ino -> when, oldest first
        self._wake = trio.Event()
        self.commits = 0  # sessions handed to ``commit``
        self.committing = False  # a commit handed out is not over yet

    def touched(self, ino: int) -> None:
        """A WRITE of ``ino`` was answered: its session is committed ``IDLE_S`` after the last one."""
        due = self._due
        due[ino] = trio.current_time() + IDLE_S
        due.move_to_end(ino)
        if len(due) == 1:
            self._wake.set()

    def pending(self) -> bool:
        """Some write session waits for its time, or is being committed."""
        return bool(self._due) or self.committing

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self._due:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            ino, when = next(iter(self._due.items()))
            wait = when - trio.current_time()
            if wait > 0:
                await trio.sleep(wait)  # (touched meanwhile: it moved to the end, the next one is looked at)
                continue
            # this one and those due within EARLY_S of now, in deadline order; one touched meanwhile
            # moved to the end with a later deadline, past the horizon
            horizon = trio.current_time() + EARLY_S
            while when <= horizon:
                del self._due[ino]
                self.commits += 1
                self.committing = True
                try:
                    await self.commit(ino)
                finally:
                    self.committing = False
                if not self._due:
                    break
                ino, when = next(iter(self._due.items()))
