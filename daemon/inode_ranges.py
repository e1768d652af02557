"""Inode numbers delegated to a mount's session, for asynchronous creates (issue 31).

A mount that creates in a directory it holds whole (daemon/callbacks.py, ``("dir", ino)``)
answers the kernel before the daemon has the create (client/async_dirops.py); the inode
number it answers with must be the one the file will have, so it comes from a range the
daemon handed its session beforehand, as CephFS delegates inode numbers to a client.

The rules
---------
* ``DelegateInodesReq(session, count)``: the daemon takes ``count`` numbers off the inode
  counter (SQLite's ``sqlite_sequence``: AUTOINCREMENT never hands out a number at or
  below it) and records the range in ``inode_ranges`` in the same transaction: durable
  before the reply, and known again after a restart (the mount's session is adopted).
* A CreateReq or MkdirReq naming ``ino`` is refused (INVALID) unless ``ino`` lies in a
  range of the asking session; a number used already is EXISTS. So no session can take
  another's numbers, nor the daemon's own.
* A session's ranges go when it expires (not within a lease of the daemon's
  start: a session of before a restart is adopted at its next request); numbers it never used are skipped, never reused
  (64-bit numbers: a hole costs nothing).
* PostgreSQL (several daemons): the numbers come from their own sequence
  (``PgStore.skip_inodes``: blocks from 2^40 up), and each daemon knows the ranges of its own
  sessions; a number its memory does not know is looked up in ``inode_ranges`` (a session
  that came over from another daemon, or from before a restart), and ranges are never read
  back whole at start (another daemon's live sessions are not this one's to expire).
"""

from __future__ import annotations

import bisect
import logging
import time

from ..common.errors import ErrorCode, StripefsError

log = logging.getLogger(__name__)

#: the most numbers one request takes, and one session may hold unused at once
MAX_COUNT = 65_536


class InodeRanges:
    def __init__(self, store, *, grace_s: float, shared: bool = False) -> None:
        self.store = store
        self.shared = shared  # several daemons over one database: this daemon's sessions only (module docstring)
        self.grace_s = grace_s  # after a start: how long a session not seen yet keeps its ranges (its lease)
        self._loaded = time.monotonic()
        self._ranges: dict[int, list[tuple[int, int]]] = {}  # session -> [(first, last)], sorted

    def load(self) -> None:
        """Read the ranges back (start-up, under the lock)."""
        self._ranges.clear()
        self._loaded = time.monotonic()
        if self.shared:
            return
        for session, first, last in self.store.inode_ranges():
            bisect.insort(self._ranges.setdefault(session, []), (first, last))

    def delegate(self, session: int, count: int) -> int:
        """Under the lock, in a write: ``count`` numbers for ``session``; the first."""
        if not session or not 0 < count <= MAX_COUNT:
            raise StripefsError(ErrorCode.INVALID, f"delegating {count} inode numbers to session {session}: 1 to {MAX_COUNT}, to a session")
        held = self._ranges.setdefault(session, [])
        if len(held) >= 4:  # the mount asks for more before it runs out: two at once at most, the rest spent
            raise StripefsError(ErrorCode.LIMIT, f"session {session} holds {len(held)} inode ranges already")
        first = self.store.skip_inodes(count)
        self.store.put_inode_range(session, first, first + count - 1)
        bisect.insort(held, (first, first + count - 1))
        return first

    def holds(self, session: int) -> bool:
        """The session has numbers delegated: it may create asynchronously (daemon/callbacks.py recalls)."""
        return bool(self._ranges.get(session))

    def others(self, session: int) -> bool:
        """Some session other than ``session`` has numbers delegated (a recall may be needed)."""
        return any(sid != session and held for sid, held in self._ranges.items())

    def check(self, session: int, ino: int) -> None:
        """A create naming ``ino`` for ``session``: refused unless the number is the session's."""
        held = self._ranges.get(session, ())
        i = bisect.bisect_right(held, (ino, float("inf"))) - 1
        if i < 0 or not held[i][0] <= ino <= held[i][1]:
            found = self.store.inode_range_of(session, ino) if self.shared and session else None
            if found is not None:  # delegated by another daemon, or before a restart (module docstring)
                bisect.insort(self._ranges.setdefault(session, []), found)
                return
            log.warning("session %d named inode %d, outside its delegated ranges: refused", session, ino)
            raise StripefsError(ErrorCode.INVALID, f"inode {ino} was not delegated to session {session}")

    def spent(self, session: int, ino: int) -> None:
        """``ino`` was used: a range whose last number went is dropped (under the lock, in the write)."""
        held = self._ranges.get(session)
        if held and held[0][1] == ino:
            held.pop(0)
            self.store.drop_inode_ranges(session, ino)

    def ended(self, alive) -> bool:
        """Some session holding a range ended (``forget_dead`` has work). Not within a lease of
        the start: the sessions of before a restart are adopted at their next request."""
        if time.monotonic() - self._loaded < self.grace_s:
            return False
        return any(not alive(sid) for sid in self._ranges)

    def forget_dead(self, alive) -> bool:
        """Ranges of sessions that ended go (under the lock, in a write); whether any did."""
        dead = [sid for sid in self._ranges if not alive(sid)]
        for sid in dead:
            del self._ranges[sid]
            self.store.drop_inode_ranges(sid)
        return bool(dead)
