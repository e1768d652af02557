"""The metadata daemon's transaction engine: the lock, savepoints, group commit.

Everything that reads or changes the database goes through one ``Txn``
(``open_txn`` picks the kind the store needs). Its public surface:

* ``lock``: the service lock. Held, no other operation runs its SQL; the
  healer, the collector and the operator requests hold it while they read a
  consistent picture (rows, node states) between awaits.
* ``await read(fn, *args)``: ``fn`` run as one read-only operation.
* ``await write(fn, *args, change=...)``: ``fn`` run as one mutating
  operation, returning once it is durable. ``write_reporting`` is the same,
  plus the attributes of some directories right after it (client/dir_attrs.py).
* ``write_locked(fn, *args, change=...)``: the same, run on the spot by a
  caller that holds ``lock``; returns the result and a batch to ``await
  batch.wait()`` on for durability.

Each operation runs at most once under a OnceReq (daemon/applied_ops.py), and
its ``change=`` (what mounts must drop: ``(inodes, entries)`` or a function of
the result giving them, or None when nothing changed) is appended to the change log in the same transaction
(daemon/change_log.py).

SQLite (``SqliteTxn``): group commit
------------------------------------
SQLite runs on the trio thread (it is fast and in-process) inside one long
transaction. A mutating request takes ``lock``, runs its SQL inside a
SAVEPOINT (a failure rolls back only its own statements), releases the lock
and waits for the next commit. The committer task (``run_committer``) wakes
when a batch is dirty, waits ``group_commit_ms`` (default 0), takes the lock,
runs COMMIT (an fsync, synchronous=FULL) in a worker thread, opens the next
transaction, and wakes every waiter of that batch. Only then are their replies
sent. Changes that arrive while a COMMIT runs wait for the lock and share the
next one, so N concurrent creates cost a few fsyncs without any added delay, a
lone writer pays one fsync and no timer, and no reply ever announces a change
that a ``kill -9`` could lose. If COMMIT fails the batch is rolled back and
its waiters get IO errors.

Read-only requests answer as soon as they hold the lock. They may see a
change another request made but whose commit is still pending (a few ms); a
crash in that window loses the change that was never acknowledged. Epochs are
the exception that matters: an epoch is only handed out once the high-water
mark covering it is durable (``alloc_epoch``).

Atomicity rule: **no ``await`` between the SQL statements of one operation.**
Each operation is one synchronous call made while holding ``lock``; the lock
is what keeps the committer from committing (or the collector from reading)
half an operation.

PostgreSQL (``PgTxn``): a transaction per request or burst
---------------------------------------------------------
No group commit and no lock on the request path. ``read`` and ``write`` run
each operation as its own transaction in a worker thread on a pooled
connection (``PgStore.run``: SERIALIZABLE for writes, a REPEATABLE READ
snapshot for reads, retried on serialization failures), committed before the
reply, so several daemons can serve one database at once (daemon/pg_store.py).
``write_locked`` (background work holding ``lock``) runs its operation as one
transaction on the spot. The burst path (daemon/burst.py) runs a burst's
operations as one transaction (``run``), each in a savepoint
(``write_reporting_locked``), the whole burst run again after a conflict.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import sqlite3
import threading
import time
from typing import Awaitable, Callable, TypeVar

import trio

from ..common import protocol as P
from ..common.errors import ErrorCode, StripefsError
from . import applied_ops, change_log

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the client a change is made for when no OnceReq names one: a request that logs a change on a
#: session's behalf (a write mark's recall, daemon/callbacks.py) sets it, so that session's own
#: holdings are spared, as a OnceReq's client's are
acting_client: contextvars.ContextVar[int] = contextvars.ContextVar("acting_client", default=0)


def _nothing() -> None:
    pass


class Batch:
    """The changes that the next COMMIT makes durable."""

    def __init__(self) -> None:
        self.dirty = False
        self.done = trio.Event()
        self.error: BaseException | None = None

    async def wait(self) -> None:
        await self.done.wait()
        if self.error is not None:
            raise StripefsError(ErrorCode.IO, f"metadata commit failed: {self.error}")


class Txn:
    """What both kinds share: the lock, one operation, and the hook every write calls."""

    #: several daemons over one database (PostgreSQL): a burst is a transaction of its own (``run``)
    shared = False
    #: what an operation of a burst raises when the whole transaction must run again (a conflict)
    reruns: tuple[type[BaseException], ...] = ()

    def __init__(self, store, *, on_write: Callable[[], None] = _nothing) -> None:
        self.store = store
        self.lock = trio.Lock()
        #: called after every write made through ``write``: figures and feeds that depend on the namespace
        self.on_write = on_write
        self._logged_seq = 0  # the change log number the last operation's change got (SQLite)
        self._logged_change: tuple | None = None  # (seq, inodes, entries, writer) of the last operation's change (SQLite)
        self.last_seq = 0  # the newest change log number logged by this daemon (SQLite)
        #: ``await after_change(seq, inodes, entries, writer)`` once a change is durable, before its reply
        #: (SQLite: the callbacks of daemon/callbacks.py; ``writer``: the OnceReq's bound client id, or 0)
        self.after_change: Callable[[int, list, list, int], Awaitable[None]] | None = None

    def _operation(self, fn: Callable[..., T], change, *args, **kwargs) -> T:
        """``fn`` as one operation runs it inside its transaction (a store retrying the
        transaction after a conflict calls this again): at most once under a OnceReq,
        its change logged with it, last (SQLite numbers it from a counter row: held briefly)."""
        result, ran = applied_ops.run_once(self.store, fn, *args, **kwargs)
        changed = change(result) if ran and callable(change) else change if ran else None
        if changed is not None:  # (a function of the result giving None: nothing changed)
            logged = self.log_in_run(*changed)
            self._logged_seq = logged[0]
            if self._logged_seq:
                self.note_logged(self._logged_seq)
                self._logged_change = logged
        return result

    def log_in_run(self, inodes: list, entries: list) -> tuple:
        """Log one change now, by the client of the OnceReq in effect: after_change's arguments
        (seq, inodes, entries, client id; seq 0: numbered later, a shared database). Also for a run
        of operations in one savepoint, a change each (daemon/burst.py ``_unlinks``), whose caller
        moves ``last_seq`` only once the savepoint held (``note_logged``): an answer must never be
        granted as of a number a rolled-back savepoint gives out again."""
        once = applied_ops.once.get()
        client_id = once.client_id if once is not None else acting_client.get()
        writer = P.writer_tag(client_id) if client_id else 0
        return (self.store.log_change(time.time_ns(), change_log.encode(inodes, entries, writer)) or 0, inodes, entries, client_id)

    def log_many_in_run(self, changes: list[tuple[list, list]]) -> list[tuple]:
        """``log_in_run`` of each (inodes, entries) of ``changes``, in order: each its own row and
        number, the rows written at once (``store.log_changes``: the counter moved once, one
        executemany), for a run of unlinks in one savepoint (daemon/namespace_bulk.py ``unlink_many``)."""
        once = applied_ops.once.get()
        client_id = once.client_id if once is not None else acting_client.get()
        writer = P.writer_tag(client_id) if client_id else 0
        seqs = self.store.log_changes(time.time_ns(), [change_log.encode(i, e, writer) for i, e in changes])
        return [(seq or 0, i, e, client_id) for seq, (i, e) in zip(seqs, changes)]

    def note_logged(self, seq: int) -> None:
        """Changes up to ``seq`` are logged by this daemon (SQLite)."""
        self.last_seq = max(self.last_seq, seq)

    async def write(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run one mutating operation and return once it is durable."""
        return (await self.write_reporting(fn, *args, report=None, **kwargs))[0]

    async def write_reporting(
        self, fn: Callable[..., T], *args, report: Callable[[], list[P.Attr]] | None, **kwargs
    ) -> tuple[T, list[P.Attr], int]:
        """``write``, plus ``report()`` (directories' attributes) right after the operation and
        the change log position they are as of (its own change's number). Only SQLite knows
        that number at once; a shared database (numbered later, daemon/change_log.py) and a
        retry answered from applied_ops report nothing."""
        raise NotImplementedError

    # the rest of the surface, per kind
    async def read(self, fn: Callable[..., T], *args, **kwargs) -> T:
        raise NotImplementedError

    def write_locked(self, fn: Callable[..., T], *args, change=None, **kwargs) -> tuple[T, Batch]:
        raise NotImplementedError

    async def alloc_epoch(self, alloc: Callable[[], tuple[int, bool]]) -> int:
        """An epoch from ``alloc`` (Namespace.alloc_epoch), returned once it is durable."""
        raise NotImplementedError

    def epoch_raised(self) -> None:
        """An operation in progress raised the epoch high-water mark: later epochs wait for its commit."""

    def begin(self) -> None:
        """Open the first transaction (once the daemon's start-up writes are done)."""

    async def run_committer(self) -> None:
        await trio.sleep_forever()

    async def commit_now(self) -> None:
        """Make every change so far durable (at shutdown)."""

    @staticmethod
    def _used_once() -> None:
        key = applied_ops.once.get()
        if key is not None:
            key.used = True  # one operation per OnceReq


class SqliteTxn(Txn):
    """One long transaction, a savepoint per operation, committed in batches (module docstring)."""

    def __init__(
        self, store, *, group_commit_ms: float, name: str, on_write: Callable[[], None] = _nothing,
        on_commit: Callable[[], None] = _nothing, on_rollback: Callable[[], None] = _nothing,
    ) -> None:
        super().__init__(store, on_write=on_write)
        self.group_commit_ms = group_commit_ms
        self.name = name  # the database, for the log
        self.on_commit = on_commit  # a batch is durable: before its waiters wake (the change feed)
        self.on_rollback = on_rollback  # a batch was rolled back: in-memory state read from the database again
        self._batch = Batch()
        self._wake_committer = trio.Event()
        self._epoch_batch: Batch | None = None  # the batch raising the epoch high-water mark
        #: a COMMIT is under way (set before its batch is swapped out, cleared once it returned): with
        #: ``pending``, what the read lane's thread reads (daemon/read_lane.py)
        self.committing = False

    @property
    def pending(self) -> bool:
        """(any thread) A change made on the database's connection may not be committed yet: the
        batch is dirty or a COMMIT is under way. False: every change made so far is committed."""
        return self.committing or self._batch.dirty

    async def read(self, fn: Callable[..., T], *args, **kwargs) -> T:
        async with self.lock:
            return fn(*args, **kwargs)

    def write_locked(self, fn: Callable[..., T], *args, change=None, wake: bool = True, **kwargs) -> tuple[T, Batch]:
        """Run one operation in its savepoint; the caller holds ``lock``. ``wake`` False: the
        caller commits the batch itself (``commit_blocking``) or calls ``wake``."""
        with self.store.savepoint():
            result = self._operation(fn, change, *args, **kwargs)
        batch = self._batch
        batch.dirty = True  # a replayed result too: its first attempt may not be committed yet
        if wake:
            self._wake_committer.set()
        return result, batch

    def wake(self) -> None:
        """The committer commits the batch soon."""
        self._wake_committer.set()

    async def write_reporting(self, fn, *args, report, **kwargs):
        try:
            async with self.lock:
                result, batch, logged, attrs, seq = self.write_reporting_locked(fn, *args, report=report, **kwargs)
        finally:
            self._used_once()
        self.on_write()
        await batch.wait()
        if logged is not None and self.after_change is not None:
            await self.after_change(*logged)
        return result, attrs, seq

    def write_reporting_locked(self, fn, *args, report, wake: bool = True, **kwargs) -> tuple[T, Batch, tuple | None, list[P.Attr], int]:
        """``write_reporting``'s part under ``lock`` (the caller holds it; daemon/burst.py runs
        many in one hold): the result, the batch to wait for, the change logged (the arguments
        of ``after_change``, or None), the reported attributes and the seq they are as of. The
        caller marks the OnceReq used and calls ``on_write`` after."""
        self._logged_seq = 0
        self._logged_change = None
        result, batch = self.write_locked(fn, *args, wake=wake, **kwargs)
        logged = self._logged_change
        attrs: list[P.Attr] = []
        seq = self._logged_seq if report is not None else 0
        if seq:
            reported = report()  # None: no attributes, only the change's seq (a commit's: daemon/callbacks.py)
            attrs = reported or []
            seq = seq if reported is None or attrs else 0
        return result, batch, logged, attrs, seq

    async def alloc_epoch(self, alloc):
        async with self.lock:
            epoch, raised = alloc()
            if raised:
                self._batch.dirty = True
                self._wake_committer.set()
                self._epoch_batch = self._batch
            batch = self._epoch_batch
        if batch is not None:
            await batch.wait()  # immediate once the high-water mark covering `epoch` is durable
        return epoch

    def epoch_raised(self) -> None:
        self._epoch_batch = self._batch

    def begin(self) -> None:
        self.store.begin()

    async def run_committer(self) -> None:
        while True:
            await self._wake_committer.wait()
            self._wake_committer = trio.Event()
            await trio.sleep(self.group_commit_ms / 1000)
            await self.commit_now()

    async def commit_now(self) -> None:
        async with self.lock:
            self.committing = True  # before the swap: ``pending`` is never False while the batch commits
            try:
                batch, self._batch = self._batch, Batch()
                if batch.dirty:
                    try:
                        await trio.to_thread.run_sync(self.store.commit)
                    except sqlite3.Error as exc:
                        self._rolled_back(batch, exc)
                    else:
                        self.on_commit()  # durable now: tell the mounts before the replies go
            finally:
                self.committing = False
            batch.done.set()

    def commit_blocking(self) -> bool:
        """Commit the batch now, on this thread, blocking it for the fsync: the burst path
        (daemon/burst.py), whose replies all wait for this commit anyway; a worker thread's
        hand-off and wake-up cost more CPU than the fsync's wait. Only with ``group_commit_ms``
        0 (a configured delay gathers more for the committer) and the lock free (no operation
        half done); False: not done, wait for the committer."""
        if self.group_commit_ms or self.lock.locked():
            return False
        self.lock.acquire_nowait()
        self.committing = True  # (``commit_now``)
        try:
            batch, self._batch = self._batch, Batch()
            if batch.dirty:
                try:
                    self.store.commit()
                except sqlite3.Error as exc:
                    self._rolled_back(batch, exc)
                else:
                    self.on_commit()
            batch.done.set()
        finally:
            self.committing = False
            self.lock.release()
        return True

    def _rolled_back(self, batch: Batch, exc: sqlite3.Error) -> None:
        log.error("COMMIT of %s failed, rolling the batch back: %s", self.name, exc)
        batch.error = exc
        self.store.rollback()
        self.store.begin()
        self.on_rollback()


class PgTxn(Txn):
    """One transaction per request or per burst, in a worker thread on a pooled connection (module docstring)."""

    shared = True

    def __init__(self, store, *, pool_size: int, on_write: Callable[[], None] = _nothing) -> None:
        super().__init__(store, on_write=on_write)
        self._local = threading.local()  # the change the last operation of this worker thread logged
        self._limiter = trio.CapacityLimiter(max(1, pool_size))
        self.reruns = store.errors  # an operation's own error is StripefsError by then (PgStore.savepoint)
        from .pg_store import Conflicted
        self.conflicted = Conflicted  # what ``run(quiet=True)`` raises when conflicts outlast the retries
        #: the change log position every change at or below which committed before a transaction that
        #: begins now (the feed's: MetaService): what a change's reported directory attributes are as of
        self.position: Callable[[], int] = lambda: 0
        self._durable = Batch()  # what a burst's operations wait for: their transaction committed before the replies
        self._durable.done.set()

    async def run(self, fn: Callable[..., T], *args, readonly: bool, hooks: bool = True, **kwargs) -> T:
        """``fn`` as one transaction of its own in a worker thread (daemon/pg_store.py). Its
        changes' reported attributes are as of ``position()`` now, before it begins: every change
        numbered at or below it is in them, a later one drops them at the mount (client/dir_attrs.py)."""
        as_of = self.position()

        @functools.wraps(fn)  # (its name in log lines, and in tests counting transactions)
        def in_thread(*args, **kwargs):
            self._local.as_of = as_of
            return fn(*args, **kwargs)

        call = functools.partial(self.store.run, in_thread, *args, readonly=readonly, hooks=hooks, **kwargs)
        return await trio.to_thread.run_sync(call, limiter=self._limiter)

    async def read(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await self.run(fn, *args, readonly=True, **kwargs)

    def write_locked(self, fn: Callable[..., T], *args, change=None, **kwargs) -> tuple[T, Batch]:
        """Its own transaction, committed now (blocks this thread meanwhile)."""
        done = Batch()
        done.done.set()
        return self.store.run(self._operation, fn, change, *args, **kwargs), done

    def _operation(self, fn, change, *args, **kwargs):
        self._local.logged = None
        return super()._operation(fn, change, *args, **kwargs)

    def log_many_in_run(self, changes: list[tuple[list, list]]) -> list[tuple]:
        """One by one: each change's row reads its directories' holds (``log_in_run``)."""
        return [self.log_in_run(i, e) for i, e in changes]

    def log_in_run(self, inodes: list, entries: list) -> tuple:
        """``Txn.log_in_run``, the row unnumbered (the sequencer's), and a fifth argument of
        ``after_change``: the holds of the directories the change names by other writers' sessions,
        read in the same statement (daemon/shared_holds.py), which the reply waits for."""
        once = applied_ops.once.get()
        client_id = once.client_id if once is not None else acting_client.get()
        writer = P.writer_tag(client_id) if client_id else 0
        event = change_log.encode(inodes, entries, writer)
        dirs = sorted({parent for parent, _ in entries})
        holders: list = []
        if dirs:
            holders = self.store.log_change_holders(time.time_ns(), event, dirs, writer)
        else:
            self.store.log_change(time.time_ns(), event)
        logged = self._local.logged = (0, inodes, entries, client_id, holders)
        return logged

    def write_reporting_locked(self, fn, *args, report, wake: bool = True, change=None, **kwargs):
        """One operation of a burst (daemon/burst.py), in its savepoint of the burst's transaction
        (``run``, in its worker thread): as ``SqliteTxn.write_reporting_locked``, with no change
        number yet (the sequencer's) and so no directories reported; the change logged carries
        the directory holds it must wait for (``log_in_run``)."""
        with self.store.savepoint():
            result = self._operation(fn, change, *args, **kwargs)
        logged = self._local.logged
        attrs, seq = self._report(report) if logged is not None else ([], 0)
        return result, self._durable, logged, attrs, seq

    def _report(self, report) -> tuple[list, int]:
        """The directories' attributes right after an operation, and the position they are as of
        (``run``'s): as ``SqliteTxn.write_reporting_locked`` reports them, with an earlier position."""
        as_of = getattr(self._local, "as_of", 0)
        if report is None or not as_of:
            return [], 0
        reported = report()  # None: no attributes, only the position
        attrs = reported or []
        return attrs, as_of if reported is None or attrs else 0

    async def write_reporting(self, fn, *args, report, **kwargs):
        change = kwargs.pop("change", None)

        def operation(*args, **kwargs):
            result = self._operation(fn, change, *args, **kwargs)
            logged = self._local.logged
            return result, logged, self._report(report) if logged is not None else ([], 0)

        try:
            result, logged, (attrs, seq) = await self.run(operation, *args, readonly=False, **kwargs)
        finally:
            self._used_once()
        self.on_write()
        if logged is not None and logged[4] and self.after_change is not None:
            await self.after_change(*logged)  # another session holds a directory it names
        return result, attrs, seq

    async def alloc_epoch(self, alloc):
        return (await self.run(alloc, readonly=False))[0]  # the database's sequence: durable as soon as handed out


def open_txn(store, config, *, name: str, on_write, on_commit, on_rollback) -> Txn:
    """The engine ``store`` needs: group commit (SQLite) or a transaction per request (PostgreSQL)."""
    if store.group_commit:
        return SqliteTxn(
            store, group_commit_ms=config.group_commit_ms, name=name,
            on_write=on_write, on_commit=on_commit, on_rollback=on_rollback,
        )
    return PgTxn(store, pool_size=config.pool_size, on_write=on_write)
