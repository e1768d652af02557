"""The metadata daemon's background work, apart from the requests (daemon/service.py).

The health sweep (every second: silent nodes go down, silent sessions expire
and their released orphans are reclaimed; a session that expires also gives
back the chunks it allocated but never committed); the one-time orphan sweep
one session lease after start (mounts that still hold an unlinked file have
re-announced it by then); the garbage collector (DeleteChunksReq in batches to
nodes that are up, one RpcClient per node, rows deleted on success); the
change feed's poll of a shared database; the trims of the change log and the
applied-ops table; and the ``duties`` lease's reads and writes.

Cluster duties (daemon/duties.py): the orphan sweep, the trash's expiry and
the garbage collector,
the repair passes, recording node states and trimming the change log and the
applied-ops table run only while this daemon holds the ``duties`` lease
(always, on SQLite); they are cancelled when it loses it.

Each runs through the transaction engine (daemon/txn.py), with the store, the
node table, the namespace and the sessions; never through the service.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from typing import Callable

import trio

from ..common import protocol as P
from ..common.errors import StripefsError
from ..common.transport import RpcClient, connect
from . import applied_ops, change_log
from .store import EXACT_PART
from .trash import EXPIRE_BATCH

log = logging.getLogger(__name__)

GC_BATCH = 1000
GC_INTERVAL_S = 1.0
#: after a wake (an unlink, a truncate...), wait this long for more garbage before a round: one
#: DeleteChunksReq per node and one commit for a burst, not per unlink (1.6 of each per unlink before).
#: 0.05 s made a round per few truncates under the data-path model tester: 0.43 DeleteChunksReq per
#: EC operation and ~0.4 ms of daemon CPU per operation; 0.5 s: 0.09 per operation (issue 35)
GC_COALESCE_S = 0.5
GC_RPC_TIMEOUT_S = 10.0
TRIM_INTERVAL_S = 30.0


class Housekeeping:
    """The background tasks of one metadata daemon (started in ``MetaService.run``'s nursery)."""

    def __init__(
        self, config, txn, store, nodes, *, ns, sessions, duties, healer, feed_views: Callable, ctx=None, callbacks=None,
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.txn = txn  # daemon/txn.py
        self.store = store
        self.nodes = nodes  # daemon/health.py NodeRegistry
        self.ns = ns  # daemon/namespace.py
        self.sessions = sessions  # daemon/health.py Sessions
        self.duties = duties  # daemon/duties.py
        self.healer = healer  # daemon/repair.py: gives back an expired session's uncommitted chunks
        self.feed_views = feed_views  # daemon/access.py: each subtree's view of the change log
        self.feed = None  # daemon/events.py ChangeFeed, set once it is open (MetaService.run)
        #: ``on_published(rows)`` after the feed published rows read from a shared database (daemon/shared_holds.py)
        self.on_published = None
        self.callbacks = callbacks  # daemon/callbacks.py: an expired session's callbacks go with it
        self.inode_ranges = None  # daemon/inode_ranges.py: an expired session's delegated numbers go with it (set by the service)
        self._gc_wake = trio.Event()
        self._feed_wake = trio.Event()
        self.gc_listeners: list = []

    def wake_gc(self) -> None:
        """Garbage was added (chunks of deleted or cut files): the collector runs a round soon, and
        ``gc_listeners`` hear it (the cold tier's collector: daemon/tiering.py)."""
        self._gc_wake.set()
        for listener in self.gc_listeners:
            listener()

    def wake_node_gc(self) -> None:
        """Node copies were queued for deletion, no file was deleted: the chunk collector only."""
        self._gc_wake.set()

    def wake_feed(self) -> None:
        """A shared database: publish this daemon's change now, not at the next poll."""
        self._feed_wake.set()

    async def release(self, inos: list[int]) -> None:
        """Inodes no session holds any more: reclaim the orphans among them (found in one read: a
        mount's heartbeat lets go of every file it created and closed, most of them named)."""
        if inos:
            inos = await self.txn.read(self.store.nameless_in, inos)
        if inos:
            reclaimed = False
            async with self.txn.lock:
                for ino in inos:
                    reclaimed = self.txn.write_locked(self.ns.reclaim_if_orphan, ino)[0] or reclaimed
            if reclaimed:
                self.wake_gc()  # what the orphans held goes now

    async def health_loop(self) -> None:
        while True:
            await trio.sleep(1.0)
            try:
                await self._health_round()
            except (StripefsError, OverflowError, sqlite3.Error):  # never the end of the daemon: logged, tried again
                log.exception("health sweep failed; trying again in a second")

    async def _health_round(self) -> None:
        now = time.monotonic()
        async with self.txn.lock:
            for node_id in self.nodes.sweep(now):
                if self.duties.leading:  # every daemon hears every node; one records the decision
                    self.txn.write_locked(self.store.set_node_state, node_id, "down")
        if not self.store.group_commit:  # an operator may have drained or removed a node through another daemon
            self.nodes.apply_admin_states(await self.txn.read(self.nodes.admin_states))
        await self.sessions_gone(self.sessions.expire(now))

    async def sessions_gone(self, released: list[int]) -> None:
        """After sessions expired or ended (``released``: the inodes nobody has open any more):
        their callbacks, uncommitted chunks and delegated inode numbers go with them."""
        await self.release(released + (self.callbacks.forget_dead() if self.callbacks is not None else []))
        if released:
            async with self.txn.lock:
                self.txn.write_locked(self.healer.reclaim_uncommitted, released)
            self.wake_gc()
        if self.inode_ranges is not None and self.inode_ranges.ended(self.sessions.alive):
            async with self.txn.lock:
                self.txn.write_locked(self.inode_ranges.forget_dead, self.sessions.alive)

    async def startup_orphan_sweep(self) -> None:
        await trio.sleep(self.config.session_lease_s)
        async with self.txn.lock:
            self.txn.write_locked(self.ns.reclaim_orphans)
        await trio.sleep_forever()  # a duty task: ends with the term

    async def feed_poll_loop(self) -> None:
        """A shared database: number the log and publish it as it grows, whichever daemon wrote it
        (daemon/change_log.py). Woken at once by this daemon's own writes, else every POLL_S.
        The rows are numbered and read in transactions of their own, then sent from this thread."""
        while True:
            with trio.move_on_after(change_log.POLL_S) as idle:
                await self._feed_wake.wait()
            self._feed_wake = trio.Event()
            try:
                # idle: one light read-only probe first (two write/read transactions every POLL_S
                # kept an idle daemon at ~30% of a core)
                if idle.cancelled_caught and not await self.txn.run(
                    self.store.feed_behind, self.feed.seq, readonly=True, hooks=False
                ):
                    continue
                await self.txn.run(self.store.number_changes, change_log.PAGE, readonly=False)
                while True:
                    rows, views = await self.txn.read(self._feed_page, self.feed.seq, self.feed.subtrees())
                    self.feed.publish(rows, views)
                    if rows and self.on_published is not None:
                        self.on_published(rows)
                    if len(rows) < change_log.PAGE:
                        break
            except StripefsError as exc:  # the database is unreachable (logged by the store): next round
                log.warning("change feed: cannot read the change log: %s", exc)
                await trio.sleep(1.0)

    def _feed_page(self, after: int, subdirs: set[str]):
        """The next page of the change log and each subtree's view of it, in one snapshot."""
        rows = self.store.changes_after(after, change_log.PAGE)
        return rows, self.feed_views(rows, subdirs) if rows and subdirs else None

    async def trim_loop(self) -> None:
        """Keep the change log and the applied-ops table bounded (a duty)."""
        while True:
            await trio.sleep(TRIM_INTERVAL_S)
            trimmed = await self.txn.write(self.store.trim_change_log, change_log.KEEP)
            expired = await self.txn.write(applied_ops.expire, self.store)
            if trimmed or expired:
                log.debug("trimmed %d change log rows and %d applied ops", trimmed, expired)

    async def take_lease(self, name: str, holder: str, now_ns: int, ttl_ns: int) -> tuple[str, int, int]:
        return await self.txn.write(self.store.take_lease, name, holder, now_ns, ttl_ns)

    async def release_lease(self, name: str, holder: str) -> None:
        await self.txn.write(self.store.release_lease, name, holder)

    async def gc_loop(self) -> None:
        # the RpcClients' nurseries must be entered and left by this task: its own exit stack
        async with contextlib.AsyncExitStack() as stack:
            await self._gc_rounds(stack)

    async def _gc_rounds(self, stack: contextlib.AsyncExitStack) -> None:
        clients: dict[tuple[int, str], RpcClient] = {}
        while True:
            with trio.move_on_after(GC_INTERVAL_S):
                await self._gc_wake.wait()
                await trio.sleep(GC_COALESCE_S)  # an rm -rf: one round per node for many unlinks
            self._gc_wake = trio.Event()
            await self._expire_trash()
            async with self.txn.lock:
                targets = [n for n in self.store.garbage_nodes() if self.nodes.is_up(n)]
            for node_id in targets:
                key = (node_id, self.nodes.address(node_id))
                if key not in clients:
                    clients[key] = await stack.enter_async_context(connect(self.ctx, key[1], timeout=GC_RPC_TIMEOUT_S))
                await self._collect(node_id, clients[key])

    async def _expire_trash(self) -> None:
        """Free what stayed in the trash past ``trash_keep_s`` (daemon/trash.py): its chunks become
        garbage, collected by the round that follows. One indexed read when nothing is due."""
        trash = self.ns.trash
        now = time.time_ns()
        async with self.txn.lock:
            if not trash.due(now):
                return
            freed = self.txn.write_locked(trash.expire, now)[0]
        if freed == EXPIRE_BATCH:
            self.wake_gc()  # more are due: the next round takes them

    async def _collect(self, node_id: int, client: RpcClient) -> None:
        async with self.txn.lock:
            rows = self.store.garbage_for_node(node_id, GC_BATCH)
        if not rows:
            return
        # a row names a chunk, every part of it, unless its part carries EXACT_PART (that part only)
        chunks = [P.ChunkId(r["ino"], r["idx"], r["part"] & ~EXACT_PART) for r in rows]
        try:
            for exact in (False, True):
                mine = [i for i, r in enumerate(rows) if bool(r["part"] & EXACT_PART) == exact]
                if mine:
                    rsp, _ = await client.call(P.DeleteChunksReq(
                        chunks=[chunks[i] for i in mine], all_parts=not exact, max_versions=[rows[i]["max_version"] for i in mine]
                    ))
        except StripefsError as exc:
            log.warning("node %d: deleting %d chunk copies failed, will retry: %s", node_id, len(chunks), exc)
            return
        async with self.txn.lock:
            self.txn.write_locked(self.store.delete_garbage, [r["id"] for r in rows])
        log.debug("node %d: %d chunk copies deleted (%s reported)", node_id, len(chunks), getattr(rsp, "deleted", "?"))
        if len(rows) == GC_BATCH:
            self.wake_gc()
