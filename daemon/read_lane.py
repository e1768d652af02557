"""The metadata daemon's read lane: a lone getattr, lookup or ping answered on a plain thread.

Under trio a request that only reads still costs the daemon an event-loop
wake-up, the socket adapter's bookkeeping and a pass through ``serve()`` and
``Burst.run`` before its one SELECT (issue 30: a GetattrReq round trip of
0.275 ms median at the client, against 0.06-0.14 ms for a bare pyzmq round
trip). So a SQLite daemon listens on a second socket, the read lane (its port
told in ``PingRsp.read_port``; ``read_listen`` in the config), served as a
storage node serves its requests (common/fast_lane.py): a thread owns the
ROUTER and answers the reads that need nothing of trio; anything else it
forwards over an inproc pipe to a ``serve()`` under trio, which serves it as the
main socket's are (the burst path, or ``handle`` in a task). The mounts' plain threads ask here
(client/meta_blocking.py); the main socket stays trio's own: a lane in front of
it cost every create a forward through the thread (daemon CPU per create 0.06
-> 0.10-0.18 ms, creates/s at 64 in flight 17,000 -> 7,000).

What the lane answers (``ReadLane.fast``; anything else, or any doubt: None,
and ``serve()`` answers it as before):

* ``PingReq``: the feed's position, read from memory.
* ``GetattrReq`` and ``LookupReq`` (bare, from a key without a subtree), when
  the daemon holds no change whose commit is pending (the batch clean and no
  COMMIT under way, ``SqliteTxn.pending``), is past the grace after a restart, and
  the read needs no recall (another session's directory held for
  asynchronous creates, or a write mark on the file: daemon/callbacks.py), a
  lookup without ``open_info`` (it opens the file for the session: trio's
  state) whose answer carries no callback grant (a regular file asked with
  ``callback``: the grant is recorded in trio's callbacks state, whose
  settle must see it atomically with the read; the task path grants it).

The read runs on a connection of the lane's own (``query_only``): WAL gives it
the last committed state, never the long transaction's uncommitted writes.
That is why "no commit pending" is checked first: the burst path answers reads
before the commit of the writes beside them (they see those writes), so once a
client has seen a change its next read must not go back to the committed state
before it; a read the lane takes while the lock is free and the batch clean
starts after every change made so far is committed, and a change made after
the check is made after the request arrived (it may or may not be seen, as on
the task path). A change is marked in the batch in the same synchronous step
that makes it (before any reply can show it), and a COMMIT is marked before its
batch is swapped out and until it returned. Whatever the lane reads is committed, and the change feed
publishes a change only after its commit: a mount that heard of a change sees
it here too.

Order per connection: the lane never answers a request of a connection that
has requests with ``serve()`` still unanswered (the fast lane's ``ordered``):
a getattr pipelined behind a create of the same mount sees the create.

Thread-safety rule: the lane thread reads trio's in-memory state (the batch's
and the committer's flags, the callbacks' and inode ranges' dicts, the
sessions) without locks, under the GIL, and never writes any of it. A dict
changed while the lane iterates it raises RuntimeError: that read goes to
``serve()``. Its SQL runs only on its own connection.
"""

from __future__ import annotations

import copy
import logging
import sqlite3
import stat
from pathlib import Path

from ..common import protocol as P
from ..common.errors import StripefsError
from .namespace import to_attr
from .store import SqliteStore

log = logging.getLogger(__name__)


def _error(exc: StripefsError) -> P.ErrorRsp:
    return P.ErrorRsp(code=int(exc.code), message=exc.message)


class ReadLane:
    """``fast`` for common/fast_lane.py on a SQLite metadata daemon (module docstring)."""

    def __init__(self, service, db_path: Path):
        self.service = service
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA query_only=ON")
        self.store = SqliteStore(conn)
        # a getattr's row as a tuple in Attr's order: Attr(*row), no sqlite3.Row and no name lookups
        # (to_attr's eleven), a few us less on the round trip's critical path (issue 30)
        self._attr_cursor = conn.cursor()
        self._attr_cursor.row_factory = None
        self._attr_sql = f"SELECT {', '.join(P.Attr.__struct_fields__)} FROM inodes WHERE ino=?"
        # the namespace's reads over this connection: lookup and getattr use only ``store``
        self.ns = copy.copy(service.ns)
        self.ns.store = self.store
        self.answered = 0  # figures for tests and the bench: requests the lane answered
        self.passed = 0  # reads of its kinds it left to serve()

    def close(self) -> None:
        self.store.conn.close()

    def fast(self, body: P.Msg, payloads: list, *, waiting: bool = False):
        kind = type(body)
        if kind is P.PingReq:
            try:
                if self.service.access.admit_now(body) is None:
                    return None
            except StripefsError as exc:  # a key no longer in the keyring, say: as MetaAccess.handle answers it
                return _error(exc)
            self.answered += 1
            return self._ping()
        if (kind is not P.GetattrReq and kind is not P.LookupReq) or payloads:
            return None
        try:
            reply = self._read(body)
        except RuntimeError:  # trio changed a dict the checks iterated: the usual path answers
            reply = None
        if reply is None:
            self.passed += 1
        else:
            self.answered += 1
        return reply

    def _ping(self) -> P.PingRsp:
        service = self.service
        feed = service.feed
        return P.PingRsp(role="meta", boot_id=service.boot_id, events_port=feed.port if feed else 0,
                         events_seq=feed.seq if feed else 0, events_log=feed.boot_id if feed else "",
                         read_port=service.read_port)

    def _settled(self) -> bool:
        """No change made so far waits for its commit (``SqliteTxn.pending``: the batch clean and no
        COMMIT under way). A task holding the lock to read (the healer, say) does not stop the lane."""
        return not self.service.txn.pending

    def _read(self, body: P.Msg):
        service = self.service
        if not self._settled():
            return None
        try:
            admitted = service.access.admit_now(body)
        except StripefsError as exc:
            return _error(exc)
        if admitted is None:  # a subtree key: inode checks and signed replies (MetaAccess.handle)
            return None
        callbacks = service.callbacks
        if callbacks.in_grace_now():
            return None
        holds = service.inode_ranges.holds
        try:
            if type(admitted) is P.GetattrReq:
                ino = admitted.ino
                if callbacks.recall_needed(admitted.session_id, ino, holds) or callbacks.written_elsewhere(admitted.session_id, ino):
                    return None
                row = self._attr_cursor.execute(self._attr_sql, (ino,)).fetchone()
                return P.AttrRsp(attr=P.Attr(*row) if row is not None else self.ns.getattr(ino))  # none: its error
            if admitted.open_info or callbacks.recall_needed(admitted.session_id, admitted.parent, holds):
                return None
            row = self.ns.lookup_row(admitted.parent, admitted.name)
            ino = row["ino"]
            if callbacks.marks and callbacks.written_elsewhere(admitted.session_id, ino):
                return None
            if service.inode_ranges.others(admitted.session_id) and callbacks.recall_needed(admitted.session_id, ino, holds):
                return None
            if admitted.callback and admitted.session_id and callbacks.enabled and stat.S_ISREG(row["mode"]):
                return None  # a grant: recorded on the trio side (module docstring)
            return P.AttrRsp(attr=to_attr(row), callback=-1)
        except StripefsError as exc:
            return _error(exc)
        except OverflowError:  # a number SQLite cannot bind: the usual path words the error
            return None
        except sqlite3.Error as exc:
            log.warning("read lane: %s: %s; the usual path answers", type(body).__name__, exc)
            return None
