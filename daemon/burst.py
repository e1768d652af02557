"""The metadata daemon's request path without a task per request: a burst, one commit.

Under trio a request used to cost the daemon a task, a semaphore, a cancel
scope, a lock acquisition and a wake-up at its group commit: over half of the
~2 ms of CPU a create cost (docs/design.md, "The request path"). So
``serve()`` (common/transport.py) takes every request waiting on the socket at
once (a burst, up to ``transport.BURST_MAX``) and hands them to ``Burst.run``,
which on the serving task itself:

1. admits each request as ``MetaAccess.handle`` would (daemon/access.py
   ``admit_now``: role, read-only, root squash; the same functions and errors)
   and builds its operation (``MetaService.operation``: a ``handle_*`` split
   into the synchronous operation and the reply built from its result). What it
   cannot run here goes back to ``serve()`` (None), which runs it in a task as
   before: a subtree key's request (its inodes are checked and its replies
   signed by ``MetaAccess.handle``), a HelloReq, a readdir, a quota recount, a
   tier recall, anything that may wait on the network.
2. takes the namespace lock once (a slice of ``SLICE`` operations at most per
   hold, so a burst of big batches never stops the daemon for long) and runs
   each operation as ``txn.write_reporting`` would: in its own savepoint (one
   failing leaves the others), at most once under a OnceReq (applied_ops), its
   change logged with it, in request order, so change numbers follow it.
3. sends the burst's reads' replies ahead (serve()'s ``early``): a read never waits
   for the fsync of the writes it arrived with; then
   commits once for them all (one fsync), on the spot and blocking
   (``txn.commit_blocking``: a worker thread's hand-off and wake-up cost more
   CPU than waiting; nothing else could use the database meanwhile), or, with
   ``group_commit_ms`` set or the lock taken, waits for the committer's commit;
   either publishes the change events before the replies go.
   An operation that finds it must first copy a snapshot's shared chunk out
   (``CopyOutNeeded``, daemon/snapshots.py: it applied nothing) is sent again on
   the task path (``redo``: the service's ``handle``), which copies and applies it,
   as a continuation: a commit planned before a snapshot appeared never answers BUSY.
   So is one that must first wait for a mount's acknowledgement it did not need
   when the burst was planned (``TaskNeeded``: a write mark on a file another
   session began caching earlier in the burst).
4. settles each change with the callbacks (daemon/callbacks.py
   ``settle_now``); a change some mount must first acknowledge leaves for trio
   as a continuation (``serve()`` runs it in a task, which waits and replies).
5. returns the replies, in request order (those sent ahead ignored); errors as ErrorRsp.

A lone lookup or getattr with the lock free (the idle daemon's common case)
skips the bookkeeping: admitted, run and answered on the spot.

On a shared database (PostgreSQL, ``txn.shared``) the same steps run but 2
and 3 are one SERIALIZABLE transaction in a worker thread (``_transaction``
through ``PgTxn.run``), a savepoint per operation, one COMMIT; a conflict with
another daemon reruns the whole burst (``PgStore.run``'s retries); no reply
before that COMMIT returned; lookups and getattrs take the usual path (a
read-only snapshot each, no conflicts with the bursts' writes); changes are
numbered by the sequencer as on the task path (daemon/change_log.py), their
reported directories are as of the feed's position before the transaction,
and a change waits only for the directory holds it found
(daemon/shared_holds.py). A burst whose conflicts outlast the retries runs its
units one transaction each.

Exclusive creates next to each other in the burst, of one client and key in
one directory (a BatchReq's, or requests of their own), run as ONE operation
(``_many``, daemon/namespace_bulk.py: one statement per table, one change
logged); each keeps its own outcome, and an error that is no create's own
undoes the run, whose creates then run one by one. On PostgreSQL too: the
run is one savepoint of the burst's transaction, and a conflict with another
daemon inside it reruns the whole transaction, as for any operation.

Unlinks next to each other of one client and key in one directory (an
``rm -rf`` the mount answered itself arrives as BatchReqs of them) run in ONE
savepoint (``_unlinks``, daemon/namespace_bulk.py ``unlink_many``): each keeps
its own checks, outcome and change (its own number and event, settled on its
own), the run shares the OnceReq records' look-up and insert, one change of
the directory's times, and one report of its attributes (in the last one's
reply, as of its number; the others carry their number alone). An error past
an unlink's checks undoes the run, whose unlinks then run one by one. SQLite
only.

Commits next to each other of one client and key (a mount's write-back
sends a ``cp -r``'s files' CommitReqs in BatchReqs) run in ONE savepoint
(``_commits``, issue 31): each is ``FileData.commit`` as alone, in order, with
its own change (own number and event, settled on its own; the rows written at
once after the last); the run shares the OnceReq records' look-up and insert.
Any error of one (a refusal, a snapshot's copy-out) undoes the run, and the
commits run one by one (``_one``): a refused commit fails alone, answered in
order. Not under a directory quota; SQLite only.

A BatchReq (many changes of one client) is a burst of its own within the
burst: each item admitted and run on its own, one BatchRsp for all. One that
would take the serving loop's burst past ``MOST`` operations (PostgreSQL:
``SHARED_MOST``) goes to a task
(``handle_batch``), which runs it through ``Burst.run`` as a burst of its own.

The rules of docs/design.md hold: no reply before the commit that makes its
change durable (a kill -9 loses nothing answered), change numbers in commit
order (one lock, one order), a retry applied once (the OnceKey in effect per
operation, bound to the sending key as ``handle_once`` binds it).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, NamedTuple

import trio

from ..common import protocol as P
from ..common import security
from ..common.errors import ErrorCode, StripefsError
from . import applied_ops, metrics
from .namespace_bulk import ManyNotHere
from .snapshots import CopyOutNeeded

log = logging.getLogger(__name__)


class TaskNeeded(StripefsError):
    """Raised by an operation before it changed anything: it must first wait for something only a
    task can wait for (another mount's acknowledgement, e.g. a write mark on a file that a session
    began caching earlier in the same burst). The burst sends its request again on the task path
    (``redo``), as it does a commit that needs a snapshot's copy-out first."""

    def __init__(self, why: str) -> None:
        super().__init__(ErrorCode.BUSY, why)


#: operations per hold of the lock: about 25 ms of work, the most others wait behind a burst
SLICE = 256
#: operations one burst of the serving loop takes at most (about 0.3 s of work): a BatchReq past it
#: is served in a task of its own, while the loop receives and answers the others
MOST = 1024
#: ``MOST`` on PostgreSQL: the serving loop awaits a burst's transaction (about 8 round trips per
#: operation), so it takes fewer; a BatchReq past it runs in a task, a transaction of its own
SHARED_MOST = 256
#: requests that only read: a lone one is answered on the spot (``Burst._read_now``)
READS = frozenset({P.LookupReq, P.GetattrReq})


class Op(NamedTuple):
    """One request's namespace operation, split from its reply (``MetaService.operation``)."""

    fn: Callable[[], object]  # synchronous, under the lock (an operation as txn.write runs it)
    write: bool  # False: a read (no savepoint, nothing to commit)
    report: Callable[[], list | None] | None  # the reported directories' attributes, right after (write only; None: the seq alone)
    change: object  # what mounts must drop (txn.write's ``change=``)
    reply: Callable[[object, list, int], P.Msg]  # (result, directory attributes, seq) -> the reply, once durable


class _Unit:
    """One operation of the burst: a request, or an item of a BatchReq."""

    __slots__ = ("op", "once", "peer", "result", "error", "batch", "logged", "attrs", "seq", "request", "redo", "body", "many")

    def __init__(self, op: Op | None, once: applied_ops.OnceKey | None, peer: str | None, error: P.ErrorRsp | None = None):
        self.op = op
        self.once = once
        self.peer = peer
        self.error = error
        self.result = None
        self.batch = None  # the group commit it waits for (a write)
        self.logged = None  # after_change's arguments
        self.attrs: list = []
        self.seq = 0
        self.request: P.Msg | None = None  # as received (a OnceReq with its wrapper): what ``redo`` resends
        self.redo = False  # a snapshot's shared chunk must be copied first: the task path runs it again
        self.body: P.Msg | None = None  # the request as admitted, its OnceReq unwrapped
        self.many: tuple | None = None  # a create (or unlink) that runs of them may share (``_runs``)


def _error(exc: StripefsError) -> P.ErrorRsp:
    return P.ErrorRsp(code=int(exc.code), message=exc.message)


class Burst:
    """``run`` is serve()'s ``burst`` for the metadata daemon (module docstring)."""

    def __init__(self, *, txn, access, kinds: frozenset[type], operation: Callable[[P.Msg], Op], settle_now, settle, release,
                 redo=None, defer: Callable[[P.Msg], bool] = lambda body: False, create_many=None,
                 unlink_many=None, commits_run: Callable[[], bool] | None = None) -> None:
        self.txn = txn  # daemon/txn.py SqliteTxn or PgTxn
        self.access = access  # daemon/access.py MetaAccess
        self.kinds = kinds  # the requests served here (bare or in a OnceReq)
        self.operation = operation  # an admitted body of ``kinds`` -> its Op
        self.settle_now = settle_now  # callbacks.settle_now
        self.settle = settle  # await settle(seq, inodes, entries, writer): the service's, for what must wait
        self.release = release  # await release(inodes): orphans nobody holds any more (housekeeping)
        self.redo = redo  # await redo(request): the task path's reply (an operation that must wait on storage nodes)
        self.defer = defer  # an admitted request left to its handler's task (a lookup that recalls its directory)
        self.create_many = create_many  # (CreateReqs of one directory) -> each one's result or StripefsError (``_many``)
        self.unlink_many = unlink_many  # (parent, names, log_changes) -> each one's change or StripefsError (``_unlinks``)
        self.commits_run = commits_run  # () -> whether commits may run as one savepoint now (``_commits``; no quota)
        self.commit_runs = 0  # runs of commits done in one savepoint (figures for tests and the bench)
        self.bursts = 0  # figures for tests and the bench
        self.requests = 0

    async def run(self, items: list[tuple[P.Msg, str | None]], early=None) -> list:
        if len(items) == 1 and not self.txn.shared and not self.txn.lock.locked():
            body, peer = items[0]
            if type(body) in READS:  # a lone read: nothing to order, hold or commit
                security.PEER.set(peer)
                self.bursts += 1
                self.requests += 1
                return [self._read_now(body)]
        plans: list = []  # per item: None (not taken), an ErrorRsp, a _Unit, or a list of _Units (a BatchReq)
        units: list[_Unit] = []
        most = SHARED_MOST if self.txn.shared else MOST
        for body, peer in items:
            security.PEER.set(peer)
            if type(body) is P.BatchReq and len(units) + len(body.items) > most and len(items) > 1:
                plans.append(None)  # in a task of its own (handle_batch: a burst of its own), the loop receiving meanwhile
                continue
            plan = self._plan(body, peer)
            plans.append(plan)
            if isinstance(plan, _Unit):
                units.append(plan)
            elif isinstance(plan, list):
                units += plan
        runnable = [u for u in units if u.op is not None]
        if runnable:
            if await self._execute(runnable):
                if early is not None:
                    try:
                        await self._reads_ahead(plans, early)
                    except BaseException:
                        self.txn.wake()  # what ran is committed all the same
                        raise
                await self._commit(runnable)
        waits = await self._settle(runnable)
        self.bursts += 1
        self.requests += len(items)
        return [self._answer(plan, waits) for plan in plans]

    def _read_now(self, body: P.Msg):
        """A lone lookup or getattr, the lock free: run on the spot (sync code: nothing can take
        the lock meanwhile), as ``_one`` would; None when ``handle`` must take it."""
        try:
            admitted = self.access.admit_now(body)
            if admitted is None or self.defer(admitted):
                return None
            op = self.operation(admitted)
            return op.reply(op.fn(), [], 0)
        except StripefsError as exc:
            return _error(exc)
        except OverflowError as exc:
            return _error(_overflow(body, exc))

    # -- 1. admission and operations --------------------------------------------------

    def _plan(self, body: P.Msg, peer: str | None):
        kind = type(body)
        if kind is P.BatchReq:
            return self._plan_batch(body, peer)
        inner = body.body if kind is P.OnceReq else body
        if type(inner) not in self.kinds:  # not served here: no checks twice
            return None
        if self.txn.shared and type(inner) in READS:  # a snapshot of its own, beside the bursts' writes (PgTxn.read)
            return None
        try:
            admitted = self.access.admit_now(body)
            if admitted is None or self.defer(admitted):
                return None
            unit = self._unit(admitted, peer)
            unit.request = body
            self._may_share(unit, peer)
            return unit
        except StripefsError as exc:
            return _error(exc)
        except OverflowError as exc:  # ``defer`` read a row by a number SQLite cannot bind: this request's error alone
            return _error(_overflow(body, exc))

    def _plan_batch(self, batch: P.BatchReq, peer: str | None):
        try:
            if self.access.admit_now(batch) is None:
                return None  # a subtree key: handle_batch, item by item through MetaAccess.handle
        except StripefsError as exc:
            return _error(exc)
        if any(type(i.body if isinstance(i, P.OnceReq) else i) not in self.kinds for i in batch.items):
            return None  # an item not served here now (daemon/service.py GATED_KINDS): handle_batch, item by item
        units = []
        for item in batch.items:
            inner = item.body if isinstance(item, P.OnceReq) else item
            if type(inner).__name__ not in P.BATCH_MESSAGES:
                units.append(_Unit(None, None, peer, P.ErrorRsp(
                    code=ErrorCode.BAD_REQUEST, message=f"{type(inner).__name__} cannot be in a BatchReq")))
                continue
            try:
                admitted = self.access.admit_now(item)
                if admitted is None:  # (not for a key admit_now took the batch of)
                    raise StripefsError(ErrorCode.ACCESS, "this key's batch items go through its subtree checks")
                units.append(self._unit(admitted, peer))
                units[-1].request = item
            except StripefsError as exc:
                units.append(_Unit(None, None, peer, _error(exc)))
            except OverflowError as exc:
                units.append(_Unit(None, None, peer, _error(_overflow(item, exc))))
        for unit in units:
            self._may_share(unit, peer)
        return units

    def _may_share(self, unit: _Unit, peer: str | None) -> None:
        """An exclusive create may share its operation with the creates next to it in the same
        directory from the same client and key (``_runs``, ``_many``)."""
        body = unit.body
        if type(body) is P.CreateReq and body.exclusive and unit.op is not None and self.create_many is not None:
            unit.many = (body.parent, unit.once.client_id if unit.once is not None else None, peer)
        elif type(body) is P.UnlinkReq and unit.op is not None and self.unlink_many is not None and not self.txn.shared:
            unit.many = ("unlink", body.parent, unit.once.client_id if unit.once is not None else None, peer)
        elif (type(body) is P.CommitReq and unit.op is not None and self.commits_run is not None and not self.txn.shared
              and self.commits_run()):
            unit.many = ("commit", unit.once.client_id if unit.once is not None else None, peer)

    def _unit(self, body: P.Msg, peer: str | None) -> _Unit:
        """The admitted ``body`` as a unit (a OnceReq: its body, under its bound key, as handle_once)."""
        once = None
        if isinstance(body, P.OnceReq):
            name = type(body.body).__name__
            if name not in P.ONCE_MESSAGES:
                raise StripefsError(ErrorCode.BAD_REQUEST, f"{name} cannot be wrapped in OnceReq")
            client_id = applied_ops.bind(body.client_id, peer)  # a retry answers only the key that made it
            once = applied_ops.OnceKey(client_id, body.op_id, body.done_below)
            body = self.access.admit_now(body.body)
            if body is None:
                raise StripefsError(ErrorCode.ACCESS, "this key's requests go through its subtree checks")
        try:
            op = self.operation(body)
        except OverflowError as exc:
            raise _overflow(body, exc) from None
        unit = _Unit(op, once, peer)
        unit.body = body
        return unit

    # -- 2. under the lock, 3. one commit ---------------------------------------------

    async def _reads_ahead(self, plans: list, early) -> None:
        """Answer the burst's reads before its commit: a read never waits for the fsync of the
        writes it came with (docs/design.md: a read may see a change whose commit is pending, as
        it does on the task path; a change is never announced before it is durable)."""
        for index, plan in enumerate(plans):
            if isinstance(plan, _Unit) and plan.op is not None and not plan.op.write and not plan.redo:
                reply = self._reply(plan)
                plans[index] = reply  # answered: run() gives serve() this, which it ignores
                await early(index, reply)

    async def _execute(self, units: list[_Unit]) -> bool:
        """Run the units under the lock, in slices; whether any wrote (``_commit`` makes it durable).
        A shared database: the units as one transaction of their own instead (``_transaction``)."""
        txn = self.txn
        if txn.shared:
            if len(units) == 1:
                return await txn.run(self._transaction, units, readonly=False)
            try:
                return await txn.run(self._transaction, units, readonly=False, quiet=True)
            except txn.conflicted as exc:
                # a big burst whose pages another daemon's bursts keep writing (SERIALIZABLE locks reads
                # by index page) loses every rerun to them: its units one transaction each get through
                log.warning("a burst of %d operations lost %s: each in a transaction of its own", len(units), exc)
                wrote = False
                for unit in units:
                    wrote = await txn.run(self._transaction, [unit], readonly=False) or wrote
                return wrote
        wrote = False
        try:
            for start in range(0, len(units), SLICE):
                lock = txn.lock
                if start:
                    await trio.lowlevel.checkpoint()  # between slices the others get their turn
                if lock.locked():
                    await lock.acquire()
                else:
                    lock.acquire_nowait()  # free: no scheduler pass
                try:
                    with txn.store.dir_cache():  # a directory read once per slice (daemon/store.py)
                        for run in _runs(units[start:start + SLICE]):
                            wrote = (self._many(run) if len(run) > 1 else self._one(run[0])) or wrote
                finally:
                    lock.release()
        except BaseException:
            txn.wake()  # cancelled (or a bug) between slices: what ran is committed all the same
            raise
        return wrote

    def _transaction(self, units: list[_Unit]) -> bool:
        """A shared database's burst (PostgreSQL): every unit in its savepoint of one SERIALIZABLE
        transaction, in a worker thread (``PgTxn.run``: committed before it returns, so before
        any reply). A conflict with another daemon's transaction aborts it all; ``PgStore.run``
        then calls this again, from a clean slate: operations only talk to the database, and a
        OnceReq's record was rolled back with its operation."""
        wrote = False
        for unit in units:
            unit.result, unit.error, unit.batch = None, None, None
            if unit.once is not None:
                unit.once.used = False
        with self.txn.store.dir_cache():  # a directory read once per transaction
            for run in _runs(units):
                wrote = (self._many(run) if len(run) > 1 else self._one(run[0])) or wrote
        return wrote

    def _many(self, units: list[_Unit]) -> bool:
        """A run of creates of one client (and key) in one directory (``_runs``: a BatchReq's
        items, or requests of their own received together) as ONE operation
        (daemon/namespace_bulk.py): one savepoint, one statement per table, one change logged for
        all (its number and the directory's attributes after it in each reply; settled once, and
        every create of it waits when it must), one look-up and one insert of their OnceReq
        records. Each create keeps its own outcome; an error that is no create's own undoes the
        whole, and they run one by one (``_one``). A run of unlinks: ``_unlinks``."""
        if type(units[0].body) is P.UnlinkReq:
            return self._unlinks(units)
        if type(units[0].body) is P.CommitReq:
            return self._commits(units)
        first = units[0]
        parent = first.body.parent
        with _one_client(units):
            try:
                made, batch, logged, attrs, seq = self.txn.write_reporting_locked(
                    self._run_many, units, report=first.op.report, wake=False,
                    change=lambda made: ([parent], [(parent, u.body.name) for u in made]) if made else None)
            except self.txn.reruns:  # a conflict (PostgreSQL): the whole transaction again (``_transaction``)
                raise
            except Exception as exc:  # noqa: BLE001 - undone as a whole: one by one, each finds its own outcome
                if not isinstance(exc, ManyNotHere):
                    log.debug("creates in directory %d one by one: %r", parent, exc)
                for unit in units:
                    unit.result, unit.error = None, None
                return any([self._one(unit) for unit in units])
        for unit in units:
            if unit.error is None:
                unit.batch = batch
        for unit in made:  # one change: settled once (``_settle``), every reply after it
            unit.attrs, unit.seq, unit.logged = attrs, seq, logged
        return any(unit.batch is not None for unit in units)  # nothing to commit when every create failed

    def _run_many(self, units: list[_Unit]) -> list[_Unit]:
        """``_many``'s operation, in its savepoint: the units it made now (OnceReqs applied before
        are answered from their records, as ``applied_ops.run_once`` answers them)."""
        store = self.txn.store
        once = units[0].once
        done = applied_ops.recorded(store, once.client_id, [u.once.op_id for u in units]) if once is not None else {}
        fresh = []
        for unit in units:
            unit.result, unit.error = done.get(unit.once.op_id) if done else None, None
            if not done or unit.once.op_id not in done:
                fresh.append(unit)
        made = []
        for unit, result in zip(fresh, self.create_many([u.body for u in fresh]) if fresh else ()):
            if isinstance(result, StripefsError):
                unit.error = _error(result)
            else:
                unit.result = result
                made.append(unit)
        if once is not None and made:
            applied_ops.record_many(store, [(u.once, u.result) for u in made])
        return made

    async def _commit(self, units: list[_Unit]) -> None:
        """One commit for the burst's writes (on the spot, or the committer's); IO errors to their units."""
        txn = self.txn
        try:
            txn.on_write()
            last = next(u.batch for u in reversed(units) if u.batch is not None)
            if not last.done.is_set() and not txn.commit_blocking():  # on the spot, or by the committer:
                txn.wake()
        except BaseException:
            txn.wake()
            raise
        try:
            await last.wait()  # batches commit in order: every earlier one is done too
        except StripefsError:
            pass
        for unit in units:
            if unit.batch is not None and unit.batch.error is not None:
                unit.error = P.ErrorRsp(code=ErrorCode.IO, message=f"metadata commit failed: {unit.batch.error}")

    def _in_one_savepoint(self, units: list[_Unit], run, expected, what: str):
        """``run(units)`` in ONE savepoint (``txn.write_locked``), as one client (``_one_client``):
        (the units it changed, the batch). Any error undoes the whole, and the units run one by one
        (``_one``), each finding its own outcome: then whether any wrote. ``expected``: the errors
        not worth a debug line (a refusal, a run not allowed here); ``what``: the run, for it."""
        with _one_client(units):
            try:
                return self.txn.write_locked(run, units, wake=False)
            except self.txn.reruns:
                raise
            except Exception as exc:  # noqa: BLE001 - undone as a whole: one by one, each finds its own outcome
                if not isinstance(exc, expected):
                    log.debug("%s one by one: %r", what, exc)
                for unit in units:
                    unit.result, unit.error, unit.logged, unit.seq = None, None, None, 0
                return any([self._one(unit) for unit in units])

    def _unlinks(self, units: list[_Unit]) -> bool:
        """A run of unlinks of one client (and key) in one directory (``_runs``) in ONE savepoint
        (daemon/namespace_bulk.py ``unlink_many``): each its own checks, outcome and change log
        row; one look-up and one insert of their OnceReq records, one change of the directory's
        times, and its attributes after the run in the last one's reply. An error past an
        unlink's checks undoes the whole, and they run one by one (``_one``)."""
        first = units[0]
        ran = self._in_one_savepoint(units, self._run_unlinks, ManyNotHere, f"unlinks in directory {first.body.parent}")
        if isinstance(ran, bool):
            return ran
        made, batch = ran
        for unit in units:
            if unit.error is None:
                unit.batch = batch
        if made:  # the savepoint held: its numbers are given out for good
            last = made[-1]
            self.txn.note_logged(last.seq)
            last.attrs = first.op.report() or []  # the directory after the run, as of its last change
        return any(unit.batch is not None for unit in units)

    def _run_unlinks(self, units: list[_Unit]) -> list[_Unit]:
        """``_unlinks``' operation, in its savepoint: the units unlinked now (OnceReqs applied
        before are answered from their records, as ``applied_ops.run_once`` answers them)."""
        store = self.txn.store
        once = units[0].once
        done = applied_ops.recorded(store, once.client_id, [u.once.op_id for u in units]) if once is not None else {}
        fresh = []
        for unit in units:
            unit.result, unit.error, unit.logged, unit.seq = done.get(unit.once.op_id) if done else None, None, None, 0
            if not done or unit.once.op_id not in done:
                fresh.append(unit)
        made = []
        names = [u.body.name for u in fresh]
        for unit, outcome in zip(fresh, self.unlink_many(units[0].body.parent, names, self.txn.log_many_in_run) if fresh else ()):
            if isinstance(outcome, StripefsError):
                unit.error = _error(outcome)
            else:
                unit.logged, unit.seq = outcome, outcome[0]
                made.append(unit)
        if once is not None and made:
            applied_ops.record_many(store, [(u.once, u.result) for u in made])
        return made

    def _commits(self, units: list[_Unit]) -> bool:
        """A run of commits of one client (and key) (``_runs``: a BatchReq's items, most often the
        files of one directory a ``cp -r`` wrote) in ONE savepoint: each commit is the operation it
        is alone (``FileData.commit``: its checks, quota, garbage, inode update), run in order, and
        keeps its own change (its own number and event, settled on its own, the rows written at
        once after the last: ``Txn.log_many_in_run``); the run shares the savepoint and one look-up
        and one insert of its OnceReq records. Any error of a commit (a refusal, a snapshot's
        copy-out, a constraint) undoes the run, and the commits run one by one (``_one``), each
        with its own outcome, so a refused commit fails alone and is answered in order. Not under
        a directory quota (``commits_run``: each commit charged on its own, as unlinks). SQLite only."""
        ran = self._in_one_savepoint(units, self._run_commits, (ManyNotHere, StripefsError), "commits")
        if isinstance(ran, bool):
            return ran
        made, batch = ran
        for unit in units:
            unit.batch = batch
        if made:  # the savepoint held: its numbers are given out for good
            self.txn.note_logged(made[-1].seq)
        self.commit_runs += 1
        metrics.COMMIT_RUNS.inc()
        metrics.COMMITS_IN_RUNS.inc(len(units))
        return True

    def _run_commits(self, units: list[_Unit]) -> list[_Unit]:
        """``_commits``' operation, in its savepoint: the units committed now (OnceReqs applied
        before are answered from their records, as ``applied_ops.run_once`` answers them)."""
        if self.commits_run is None or not self.commits_run():
            raise ManyNotHere("commits under a directory quota are charged one by one")
        store = self.txn.store
        once = units[0].once
        done = applied_ops.recorded(store, once.client_id, [u.once.op_id for u in units]) if once is not None else {}
        made = []
        for unit in units:
            unit.error, unit.logged, unit.seq, unit.attrs = None, None, 0, []
            if done and unit.once.op_id in done:
                unit.result = done[unit.once.op_id]
                continue
            unit.result = unit.op.fn()  # an error: raised, the run undone (``_commits``)
            made.append(unit)
        if made:
            for unit, logged in zip(made, self.txn.log_many_in_run([unit.op.change for unit in made])):
                unit.logged, unit.seq = logged, logged[0]
            if once is not None:
                applied_ops.record_many(store, [(u.once, u.result) for u in made])
        return made

    def _one(self, unit: _Unit) -> bool:
        """Run one operation (the lock held); whether it wrote."""
        op = unit.op
        security.PEER.set(unit.peer)
        token = applied_ops.once.set(unit.once) if unit.once is not None else None
        try:
            if op.write:
                unit.result, unit.batch, unit.logged, unit.attrs, unit.seq = self.txn.write_reporting_locked(
                    op.fn, report=op.report, change=op.change, wake=False)  # committed by _execute
                return True
            unit.result = op.fn()
        except (CopyOutNeeded, TaskNeeded) as exc:  # nothing applied; what it waits for needs a task (_later)
            unit.error, unit.redo = _error(exc), self.redo is not None and unit.request is not None
        except self.txn.reruns:  # a conflict: the whole transaction again (``_transaction``)
            raise
        except StripefsError as exc:
            unit.error = _error(exc)
        except OverflowError as exc:  # SQLite stores signed 64-bit integers
            unit.error = _error(_overflow(None, exc))
        except Exception as exc:  # noqa: BLE001 - a bug: answered and logged loudly, the others go on
            log.exception("the burst's operation %s failed", getattr(op.fn, "__qualname__", op.fn))
            unit.error = P.ErrorRsp(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        finally:
            if token is not None:
                unit.once.used = True  # one operation per OnceReq
                applied_ops.once.reset(token)
        return False

    # -- 4. callbacks ---------------------------------------------------------------------

    async def _settle(self, units: list[_Unit]) -> set[int]:
        """Settle each durable change that waits for nobody; the ids of the units that must wait."""
        waits: set[int] = set()
        freed: list[int] = []
        wait: dict[int, bool] = {}  # per change (a run of creates shares one: ``_many``): whether it waits
        for unit in units:
            if unit.logged is None or unit.error is not None:
                continue
            change = id(unit.logged)
            if change not in wait:
                done = self.settle_now(*unit.logged)
                wait[change] = done is None
                freed += done or []
            if wait[change]:
                waits.add(id(unit))
        if freed:
            await self.release(freed)
        return waits

    # -- 5. replies ----------------------------------------------------------------------

    def _answer(self, plan, waits: set[int]):
        if not isinstance(plan, (_Unit, list)):
            return plan  # None (not taken), an ErrorRsp, or a read's reply sent ahead (_reads_ahead)
        units = plan if isinstance(plan, list) else [plan]
        if any(id(u) in waits or u.redo for u in units):
            return self._later(plan, units, waits)
        replies = [self._reply(u) for u in units]
        return P.BatchRsp(results=replies) if isinstance(plan, list) else replies[0]

    def _later(self, plan, units: list[_Unit], waits: set[int]):
        """A continuation: waits for the mounts a change must hear first, then the reply (in a task)."""

        async def later() -> P.Msg:
            settled: set[int] = set()
            for unit in units:
                if id(unit) in waits and id(unit.logged) not in settled:
                    settled.add(id(unit.logged))
                    await self.settle(*unit.logged)  # (another request's continuation may wait for it too)
            replies = [await self._redone(u) if u.redo else self._reply(u) for u in units]
            if isinstance(plan, list):
                return P.BatchRsp(results=replies)
            if isinstance(replies[0], P.ErrorRsp):
                raise StripefsError(replies[0].code, replies[0].message)
            return replies[0]

        return later

    async def _redone(self, unit: _Unit) -> P.Msg:
        """A unit whose operation needed a snapshot's copy-out first (daemon/snapshot_service.py):
        the request again on the task path, which copies and then applies it."""
        security.PEER.set(unit.peer)
        try:
            return await self.redo(unit.request)
        except StripefsError as exc:
            return _error(exc)

    def _reply(self, unit: _Unit) -> P.Msg:
        if unit.error is not None:
            return unit.error
        security.PEER.set(unit.peer)  # a reply may grant a callback to the asking key's session
        try:
            return unit.op.reply(unit.result, unit.attrs, unit.seq)
        except StripefsError as exc:
            return _error(exc)


@contextlib.contextmanager
def _one_client(units: list[_Unit]) -> Iterator[None]:
    """Around a run of one client's operations run as one (``Burst._many``, ``Burst._unlinks``):
    the first's peer, and its OnceReq's client as the changes' writer (``Txn.log_in_run`` reads
    it; ``used``: no record of its own). On the way out, after a fallback to one by one inside
    the block, each OnceReq is marked used (one operation per OnceReq)."""
    first = units[0]
    security.PEER.set(first.peer)
    once = first.once
    key = applied_ops.OnceKey(once.client_id, 0, once.done_below, used=True) if once is not None else None
    token = applied_ops.once.set(key) if key is not None else None
    try:
        yield
    finally:
        if token is not None:
            applied_ops.once.reset(token)
        for unit in units:
            if unit.once is not None:
                unit.once.used = True


def _runs(units: list[_Unit]) -> list[list[_Unit]]:
    """``units`` cut into runs: creates one after another with one ``many`` key (one directory,
    one client, one key: a BatchReq's items or requests of their own) and distinct OnceReq
    numbers (``Burst._many``), and single units."""
    runs: list[list[_Unit]] = []
    ids: set = set()
    for unit in units:
        run = runs[-1] if runs else None
        op_id = unit.once.op_id if unit.once is not None else None
        if unit.many is not None and run and run[-1].many == unit.many and (op_id is None or op_id not in ids):
            run.append(unit)
        else:
            runs.append([unit])
            ids = set()
        if op_id is not None:
            ids.add(op_id)
    return runs


def _overflow(body: P.Msg | None, exc: OverflowError) -> StripefsError:
    name = type(body).__name__ if body is not None else "the request"
    log.warning("refusing %s: a number is out of range: %s", name, exc)
    return StripefsError(ErrorCode.BAD_REQUEST, f"a number in {name} is out of range (signed 64-bit)")
