"""Asynchronous creates, mkdirs, unlinks and rmdirs in a directory this mount holds whole (issue 31;
CephFS "async dirops").

A create costs the mount one round trip to the metadata daemon and the daemon's
group commit; a program creating files one after another (``cp -r``, ``tar x``,
a training job writing its outputs) waits for both per file. Where the mount
holds a callback on every name of the directory (daemon/callbacks.py,
``("dir", ino)``), it already knows the name is free and that no other mount
can change the directory without waiting for it, so it answers the kernel at
once and sends the creates afterwards, many in one ``BatchReq`` (the daemon's
burst path: one transaction, one fsync).

The rules
---------
* Answered on the FUSE session's reader thread (Operations' ``_fast_create``,
  ``_fast_mkdir``, ``_fast_unlink``, ``_fast_rmdir``, ``_fast_rename``, under ``Operations.lock``):
  no trio task per change; the flusher is woken through the trio token.
* The new file's inode number is final when the kernel gets it: it comes from
  a range the daemon delegated to this session (``DelegateInodesReq``,
  daemon/inode_ranges.py). With none left the create is synchronous (and the
  pool is refilled in the background). A new session (the daemon forgot the
  old one) starts without numbers: those were the old session's.
* A mkdir is answered the same way; the new directory is held whole at once
  (it has no names), so what is made in it is answered here too.
* An unlink of a name whose file is not open here, and an rmdir of a
  directory held whole and known empty, are answered the same way
  (the kernel already dropped the name; the mount forgets it), and sent in
  the same queue, so creates and unlinks reach the daemon in the order the
  kernel was answered. One refused after the answer (a permission the daemon
  checks, say) is logged and counted; the mount forgets what it knew of the
  directory, so the name is found again at its next lookup.
* Pending changes are sent, in order, when ``DELAY_S`` passed since the first
  of them, when ``BATCH`` are pending, when ``DRAIN`` piled up while the flusher's
  last batch was at the daemon (sent as soon as it is answered: ``flush``'s
  ``drain``), and before anything that must see them
  at the daemon: another request of this mount that names the directory or the
  new file (``settle``: a write, an open by inode, a listing, an unlink, a
  rename ...), an fsync of the file or of the directory, the acknowledgement
  of a change another mount made in the directory (the daemon holds that
  change until this mount acknowledges it: client/kernel_cache.py calls
  ``flush`` first), and unmount.
* What close and fsync promise (docs/design.md "The durability promise"): a
  file created here is durable once an fsync of it or of its directory
  returned, or ``DELAY_S`` plus a round trip after its close; a kill -9 of
  the mount before then may lose the creates not sent yet, and nothing else.
* A rename of a file (not a directory: a directory moved changes ``..`` and two nlinks) whose
  name this mount knows, in a directory it holds whole, to a name free in what it knows of
  another held directory (or the same), flags 0 or RENAME_NOREPLACE, is answered the same way
  (``_fast_rename``): a replaced target may be open on another mount, so that one is asked. Its
  ``Pending`` carries the new (parent, name) too, and counts as a change of both directories
  (``busy``, ``naming`` and ``settle`` see either name).
* A create the daemon refuses after the kernel was answered (a quota, a name
  taken through a path this mount could not see, a permission) is logged
  (WARNING), counted (``refused``, the mount's metric
  ``stripefs_async_refused_total``), its name and inode are dropped from the
  kernel, and the next operation on that file fails with the error, once (the
  CephFS rule). Operations on it that were already answered stay answered. A rename refused
  the same way: both names are dropped from the kernel, both directories are asked again, and
  the file's next operation fails once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import trio

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError, error_from
from .batching import FlushTimer, count_down
from .metrics import ASYNC_CREATES, ASYNC_REFUSED

log = logging.getLogger(__name__)

#: the longest a create waits here before it is sent
DELAY_S = 0.1
#: creates sent together at most (the daemon's BatchReq limit is larger)
BATCH = 256
#: what the flusher sends at once, without waiting for a full batch or the delay, when this many
#: are queued by the time the daemon answered the last batch (``flush``, ``drain``)
DRAIN = BATCH // 2
#: inode numbers asked for at once, and the number left that asks for more
RANGE = 4096
LOW = 1024


@dataclass
class Pending:
    """One create, unlink or rename answered here and not yet by the daemon (``ino``: the file made,
    unlinked or moved; a rename's new name is ``new_parent``, ``new_name``)."""

    request: p.Msg
    parent: int
    name: bytes
    ino: int
    new_parent: int = 0
    new_name: bytes = b""
    done: trio.Event = field(default_factory=trio.Event)
    reply: p.Msg | None = None  # the daemon's OpenRsp (or ErrorRsp), once done

    @property
    def dirs(self) -> tuple[int, ...]:
        """The directories it changes."""
        return (self.parent, self.new_parent) if self.new_parent and self.new_parent != self.parent else (self.parent,)

    def names(self, parent: int, name: bytes) -> bool:
        return (self.parent == parent and self.name == name) or (self.new_parent == parent and self.new_name == name)


class AsyncDirops:
    def __init__(self, meta, *, on_reply: Callable[[Pending], None] = lambda pending: None, lock=None) -> None:
        self.meta = meta  # client/meta_rpc.py MetaClient
        # changes are answered on the FUSE session's reader thread (Operations' _fast_* paths, under
        # this lock: Operations.lock), sent and answered in trio: the queue is changed under it
        self.lock = lock if lock is not None else threading.RLock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._trio_thread = 0
        self.on_reply = on_reply  # Operations: the daemon answered a pending create (refused or not)
        self.enabled = True
        self._ranges: list[tuple[int, int]] = []  # delegated numbers not used yet: (next, last)
        self._session = 0  # the session they were delegated to (a new session, after a daemon forgot us, has none)
        self._asking = False
        self._queue: list[Pending] = []  # answered here, not sent yet, in order
        self._unanswered: list[Pending] = []  # answered here, not answered by the daemon yet, in order
        self._inos: dict[int, int] = {}  # ino -> its changes in _unanswered
        self._dirs: dict[int, int] = {}  # parent -> its changes in _unanswered
        self._send_lock = trio.Lock()
        self._timer = FlushTimer()
        self._first_at = 0.0  # (time.monotonic) when the oldest change in the queue was answered
        self.failed: dict[int, StripefsError] = {}  # ino -> the error its next operation fails with
        self.refused = 0  # creates refused after the kernel was answered
        self.sent = 0  # creates sent asynchronously
        self.nursery: trio.Nursery | None = None

    # ------------------------------------------------------------ numbers

    def take_ino(self) -> int | None:
        """A delegated inode number, or None (none left: create synchronously; more are asked for)."""
        if self._session != self.meta.session_id:
            self._ranges.clear()  # another session's numbers: refused if named (daemon/inode_ranges.py)
        ino = None
        while self._ranges and ino is None:
            first, last = self._ranges[0]
            ino = first
            if first == last:
                self._ranges.pop(0)
            else:
                self._ranges[0] = (first + 1, last)
        ranges = self._ranges  # (the first range alone is enough, most of the time: no sum per create)
        if (not ranges or ranges[0][1] - ranges[0][0] < LOW) and self.left() < LOW and not self._asking \
                and self.nursery is not None:
            self._asking = True
            self.in_trio(self.nursery.start_soon, self._ask_numbers)
        return ino

    def in_trio(self, fn, *args) -> None:
        """``fn(*args)`` on the trio thread: now if this is it, else soon (the reader thread)."""
        if threading.get_ident() == self._trio_thread or self._token is None:
            fn(*args)
        else:
            self._token.run_sync_soon(fn, *args)

    def left(self) -> int:
        return sum(last - first + 1 for first, last in self._ranges)

    async def _ask_numbers(self) -> None:
        try:
            session = self.meta.session_id
            rsp = await self.meta.call(p.DelegateInodesReq(session_id=session, count=RANGE))
            if session != self._session:
                self._ranges.clear()
                self._session = session
            self._ranges.append((rsp.first, rsp.first + rsp.count - 1))
        except StripefsError as exc:
            if exc.code == ErrorCode.UNAVAILABLE:  # the daemon delegates none (PostgreSQL before issue 30): synchronous
                log.info("asynchronous creates off: %s", exc.message)
                self.enabled = False
            else:
                log.debug("asking for inode numbers: %s", exc)
        finally:
            self._asking = False

    # ------------------------------------------------------------ pending creates

    def add(self, pending: Pending) -> None:
        """A change the kernel was answered for: sent within DELAY_S (or sooner). Any thread."""
        with self.lock:
            self._queue.append(pending)
            self._unanswered.append(pending)
            self._inos[pending.ino] = self._inos.get(pending.ino, 0) + 1
            for parent in pending.dirs:
                self._dirs[parent] = self._dirs.get(parent, 0) + 1
            first, full = len(self._queue) == 1, len(self._queue) == BATCH
            if first:
                self._first_at = time.monotonic()  # the flusher's delay counts from here (``run``)
        if first or full:
            self.in_trio(self._poke, full)

    def _poke(self, full: bool) -> None:
        self._timer.queued(first=True, full=full)

    @property
    def unanswered(self) -> bool:
        """Some change answered here has no answer from the daemon yet."""
        return bool(self._unanswered)

    def pending(self, ino: int) -> bool:
        """A change of ``ino`` answered here has no answer from the daemon yet."""
        return ino in self._inos

    def naming(self, parent: int, name: bytes) -> bool:
        """Some change of ``name`` in ``parent`` answered here has no answer from the daemon yet."""
        if parent not in self._dirs:
            return False
        with self.lock:
            return any(q.names(parent, name) for q in self._unanswered)

    def busy(self, *inodes: int) -> bool:
        """Some change of these inodes, or in these directories, is not answered by the daemon yet."""
        return any(ino in self._inos or ino in self._dirs for ino in inodes)

    def take_error(self, ino: int) -> StripefsError | None:
        """The error the next operation on ``ino`` fails with (once), if its create was refused."""
        return self.failed.pop(ino, None) if self.failed else None

    async def settle(self, *inodes: int) -> None:
        """Return once the daemon answered every create of these inodes or in these directories
        (every pending one, when none is named)."""
        if not self._unanswered:
            return
        if inodes and not self.busy(*inodes):
            return
        with self.lock:
            wait = [q for q in self._unanswered if not inodes or q.ino in inodes or not set(q.dirs).isdisjoint(inodes)]
        await self.flush()
        for q in wait:
            await q.done.wait()

    async def flush(self, drain: bool = False) -> None:
        """Send everything pending now, and wait for the daemon's answers. What is answered here
        meanwhile waits for the flusher's next turn (``DELAY_S`` after the first of it, or a full
        batch) or the next flush: sending it at once, a batch per round trip, cut a steady stream
        of creates (bench/meta_ops.py) into batches of ~50, each its own transaction, fsync and
        reply at the daemon, instead of full ones.

        ``drain`` (the flusher's own turns): unless fewer than ``DRAIN`` were answered here
        meanwhile, those go at once too, and so on. An ``rm -rf`` answers unlinks faster than a
        loaded daemon takes them (a batch of 256 in 30-66 ms on 2 busy cores, the kernel's next
        256 in ~17 ms): waiting for the next full batch left the daemon idle between batches,
        and the final ``rmdir`` then waited for the backlog. The lock is let go between turns (trio's
        is fair), so a flush that must return soon (an acknowledgement's, a settle's) is not held
        behind a stream. A remainder of a few past a whole batch rides with it (``_batches``)
        instead of costing a round trip, a transaction and an fsync of its own."""
        while True:
            async with self._send_lock:
                with self.lock:
                    pending, self._queue = self._queue, []
                for batch in _batches(pending):
                    await self._send(batch)
            if not drain or len(self._queue) < DRAIN:
                return

    async def _send(self, batch: list[Pending]) -> None:
        self.sent += len(batch)
        ASYNC_CREATES.inc(len(batch))
        try:
            results = await self.meta.call_batch([q.request for q in batch])
        except StripefsError as exc:  # the daemon could not be reached within the retry window
            results = [p.ErrorRsp(code=int(exc.code), message=exc.message)] * len(batch)
        for q, result in zip(batch, results):
            q.reply = result
            if isinstance(result, p.ErrorRsp):
                self.refused += 1
                ASYNC_REFUSED.inc()
                if not isinstance(q.request, (p.UnlinkReq, p.RmdirReq)):  # an unlink refused: the name is there again
                    self.failed[q.ino] = error_from(result.code, result.message)
                moved = f" to {q.new_name!r} in directory {q.new_parent}" if q.new_parent else ""
                log.warning("asynchronous %s of %r in directory %d%s (inode %d) refused after the kernel was answered: %s",
                            p.kind(q.request)[:-3].lower(), q.name, q.parent, moved, q.ino, result.message)
            try:
                self.on_reply(q)
            finally:
                with self.lock:
                    self._unanswered.remove(q)  # (the oldest: answers come in order)
                    count_down(self._inos, q.ino)
                    for parent in q.dirs:
                        count_down(self._dirs, parent)
                q.done.set()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The flusher: sends what is pending DELAY_S after the first of it, or once BATCH wait."""
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            task_status.started()
            await self._timer.run(lambda: self.flush(drain=True), lambda: max(0.0, DELAY_S - (time.monotonic() - self._first_at)))


def _batches(pending: list[Pending]) -> list[list[Pending]]:
    """``pending`` in BatchReqs of ``BATCH``, the last taking up to ``DRAIN`` more (well within the
    daemon's ``MAX_BATCH``, and its burst's ``MOST``) rather than leaving a small one of its own."""
    out = []
    start = 0
    while len(pending) - start > BATCH + DRAIN:
        out.append(pending[start:start + BATCH])
        start += BATCH
    if start < len(pending):
        out.append(pending[start:])
    return out
