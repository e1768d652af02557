"""Directories held across daemons sharing one database (PostgreSQL): the rows, and the waits.

Callbacks (daemon/callbacks.py) live in a daemon's memory; with several daemons
over one database, a change made through daemon B of a directory that a
session of daemon A holds whole must wait for that session as if A had made it
(docs/design.md, "Callbacks across daemons"). The rules:

* A directory holding is also a row of ``dir_holds`` (ino, boot_id, session,
  grant_id, writer): written by ``hold_row`` inside the SERIALIZABLE transaction
  that reads what the grant covers (the whole listing, the mkdir), the
  in-memory grant made after its COMMIT by ``granted`` (as of a position read
  before that transaction began), deleted when the holding ends
  (``Callbacks.on_dir_dropped``; a flusher task writes the deletions). A grant
  refused after its COMMIT (a penalty meanwhile) deletes its row at once.
  ``grant_id`` names one grant (the table has no unique key: see daemon/db.py): a
  deletion never removes a newer grant's row, and a re-grant deletes the older.
* A grant also marks the directory's own row (``inodes.held_by``: the only
  holder's writer tag, or -1). A change reads that mark of the directories its
  entries name in its change-log INSERT, and their rows only when another
  writer holds one (``PgStore.log_change_holders``, daemon/txn.py ``PgTxn``).
  Every change of a directory's entries writes its row (times, nlink), and so
  does a grant: a grant and a change that do not see each other conflict on it,
  one is rerun (docs/design.md: why not a predicate lock on ``dir_holds``).
  Finding rows, the changing daemon answers only once each is gone, or after
  ``SHARED_WAIT_S`` (``wait_for``), then deletes those left, so that no later
  change waits for them.
* The holder's daemon settles every change its feed publishes that some session
  of its own must acknowledge (``published``): ``Callbacks.settle``, penalties
  included; the holding ends with it, and so does the row. A holder on the
  changing daemon itself is settled the same way, by its own feed.
* A read (lookup, getattr, listing) of a directory that another session holds
  with inode numbers delegated first logs a change naming it (``recall``),
  which waits as above: the holder sends what it answered before it
  acknowledges.
* A daemon's rows go with its ``daemons`` row (``forget_dead_daemons``); rows of a
  daemon that expired do not count as holders meanwhile (``dir_holds_left``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time

import trio

from ..common import protocol as P
from . import change_log
from .callbacks import WAIT_S

log = logging.getLogger(__name__)

#: the longest a change waits for another daemon's holder: the holder's daemon waits WAIT_S from
#: when its feed publishes the change (POLL_S at most after the commit), then ends the holding
SHARED_WAIT_S = WAIT_S + change_log.POLL_S + 1.0
#: how often a waiting change looks at the rows: first, and at most (doubling in between)
POLL_FIRST_S = 0.002
POLL_MOST_S = 0.02


def _nothing() -> None:
    pass


class SharedHolds:
    def __init__(self, txn, store, callbacks, boot_id: str) -> None:
        self.txn = txn  # daemon/txn.py PgTxn
        self.store = store
        self.callbacks = callbacks
        self.boot_id = boot_id
        self._grant_ids = itertools.count(time.time_ns())  # rows are keyed by boot id too: unique enough
        self._rows: dict[tuple[int, int], int] = {}  # (ino, session) -> grant_id of its row
        self._dropped: list[tuple[int, str, int, int]] = []  # rows to delete (the flusher's)
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        callbacks.on_dir_dropped = self._on_dropped
        self.waits = 0  # changes that waited for a holder's row
        self.timeouts = 0  # ... and found it still there after SHARED_WAIT_S

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The deletions' flusher, and the nursery of the settles ``published`` starts."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                rows, self._dropped = self._dropped, []
                if not rows:
                    continue
                try:
                    await self.txn.write(self.store.drop_dir_holds, rows)
                except Exception as exc:  # noqa: BLE001 - the database is unreachable: next round
                    log.warning("directory holds not deleted from the database, will retry: %s", exc)
                    self._dropped += rows
                    await trio.sleep(1.0)
                    self._wake.set()

    def forget_all(self) -> None:
        """At a clean stop (blocking): this daemon's rows go, so that no change waits for them."""
        try:
            self.store.run(self.store.drop_dir_holds_of, self.boot_id)
        except Exception as exc:  # noqa: BLE001 - the database is gone: other daemons wait SHARED_WAIT_S once
            log.warning("directory holds of this daemon not deleted at its stop: %s", exc)

    # -- grants ----------------------------------------------------------------------

    def hold_row(self, ino: int, session: int) -> int:
        """In the grant's transaction (a worker thread): the row of ``session``'s holding of ``ino``;
        its grant id, for ``granted``."""
        grant_id = next(self._grant_ids)
        self.store.put_dir_hold(ino, self.boot_id, session, grant_id, P.writer_tag(self.callbacks.client_of(session)))
        return grant_id

    def granted(self, ino: int, session: int, grant_id: int, as_of: int) -> int:
        """After the grant's COMMIT (the trio thread): the holding in memory, as of ``as_of``; its
        seq, or -1 (refused meanwhile: the row goes)."""
        seq = self.callbacks.grant_dir(session, ino, as_of)
        older = self._rows.get((ino, session))
        if seq < 0 or (older is not None and older > grant_id):  # refused, or a later grant's row stands
            self._drop_row((ino, self.boot_id, session, grant_id))
        else:
            self._rows[(ino, session)] = grant_id
            if older is not None:  # a re-grant: its row replaces the older one
                self._drop_row((ino, self.boot_id, session, older))
        return seq

    def _on_dropped(self, ino: int, session: int) -> None:
        grant_id = self._rows.pop((ino, session), None)
        if grant_id is not None:
            self._drop_row((ino, self.boot_id, session, grant_id))

    def _drop_row(self, row: tuple[int, str, int, int]) -> None:
        self._dropped.append(row)
        self._wake.set()

    # -- changes ---------------------------------------------------------------------

    async def wait_for(self, holders: list) -> None:
        """A change found ``holders`` (rows: ino, boot_id, session, grant_id) in its transaction:
        return once their daemons ended each holding (the row gone), or after ``SHARED_WAIT_S``."""
        want = {tuple(h) for h in holders}
        if not want:
            return
        self.waits += 1
        inos = sorted({h[0] for h in want})
        deadline = trio.current_time() + SHARED_WAIT_S
        delay = POLL_FIRST_S
        while True:
            await trio.sleep(delay)
            want &= await self.txn.read(self.store.dir_holds_left, inos, time.time_ns())
            if not want:
                return
            if trio.current_time() >= deadline:
                break
            delay = min(2 * delay, POLL_MOST_S)
        self.timeouts += 1
        log.warning("a change of directories %s waited %.1fs for %d holder(s) through other daemons (%s) that did "
                    "not let go: answered without them, their holds dropped", inos, SHARED_WAIT_S, len(want),
                    ", ".join(sorted({h[1][:8] for h in want})))
        await self.txn.write(self.store.drop_dir_holds, sorted(want))

    def published(self, rows: list[tuple[int, bytes]]) -> None:
        """The feed published ``rows`` (on the trio thread): each change some session of this
        daemon must acknowledge is settled in a task of its own (``Callbacks.settle``)."""
        if self._nursery is None or not self._rows:
            return
        for seq, blob in rows:
            inodes, entries, tag = change_log.decode_writer(blob)
            if entries and self.callbacks.must_wait(seq, inodes, entries, tag):
                self._nursery.start_soon(functools.partial(self.callbacks.settle, seq, inodes, entries, tag, tagged=True))

    # -- reads -----------------------------------------------------------------------

    async def recall(self, session: int, parent: int, name: bytes, child: bool = False) -> None:
        """Before a read by ``session`` of directory ``parent`` (and, ``child``: of what ``name``
        names in it): each of them held by another session that creates there asynchronously is
        recalled by a change naming it, which waits for the holder (the module docstring)."""
        held = await self.txn.read(_async_holders, self.store, session, parent, name if child else None)
        for ino in held:
            await self.txn.write(_nothing, change=([], [(parent, name)] if ino == parent else [(ino, b"")]))


def _async_holders(store, session: int, parent: int, name: bytes | None) -> list[int]:
    inos = [parent]
    if name is not None:
        row = store.get_dentry(parent, name)
        if row is not None:
            inos.append(row["ino"])
    return sorted(store.async_holders(inos, session))
