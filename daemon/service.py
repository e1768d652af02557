"""The metadata daemon's server: decode, dispatch, background work.

``MetaService.handle`` dispatches each request body to ``handle_<tag>``
(``CreateReq`` has tag ``create``: ``handle_create``). Messages the daemon
does not serve (a storage node's ``ReadChunkReq``, say) get UNKNOWN_MESSAGE.

Transactions: daemon/txn.py
----------------------------
Every operation runs through ``self.txn`` (``txn.read``, ``txn.write``, and
``txn.write_locked`` under ``txn.lock``): group commit on SQLite, one
transaction per request on PostgreSQL, where several daemons serve one
database at once. Open files are then shared between daemons through the
database (daemon/open_holds.py), so an unlinked file stays while a mount of
any daemon holds it. Each operation is one synchronous Namespace call: **no
``await`` between the SQL statements of one operation** (daemon/txn.py says
why). The healer, the operator requests, quotas, access checks and open holds
get the same engine, the store and the node table, never this class.

The request path (daemon/burst.py): with SQLite, ``serve()`` hands every
request waiting on the socket to ``Burst.run`` at once; the requests of
``BURST_KINDS`` run there without a task each, through ``operation`` (their
``_op_<tag>``: the operation and the reply built from its result, which their
``handle_<tag>`` runs too), in one hold of the lock and one commit (PostgreSQL: one transaction). The
rest goes through ``handle`` in a task of its own. With SQLite a second socket, the
read lane (daemon/read_lane.py, its port told in PingRsp.read_port), is served by a
thread of its own, which answers lone reads that need nothing of trio itself: what
the mounts' plain threads ask (client/meta_blocking.py).

Background tasks (all in ``run``'s nursery): the committer (daemon/txn.py),
the health sweep, orphan sweeps, the garbage collector, the change feed's poll
and the trims (daemon/housekeeping.py), open holds (daemon/open_holds.py) and
the healer (daemon/repair.py: re-replication, drain, bad copies; its and the
operator requests' ``handle_*`` methods are dispatched like this class's own).

Every mutating operation goes through ``txn.write`` (or ``txn.write_locked``):
under a OnceReq it runs at most once (daemon/applied_ops.py), and its
``change=`` (what mounts must drop) is appended to the change log in the same
transaction; the feed publishes the log after the commit (daemon/change_log.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import stat
import threading
import uuid
from pathlib import Path
from typing import Callable, TypeVar

import trio
import zmq

from ..common import capability
from ..common import protocol as P
from ..common.config import MetaConfig
from ..common.errors import ErrorCode, QuietError, StripefsError
from ..common.layout import MAX_CHUNK_SIZE
from ..common.fast_lane import serve_with_fast_lane
from ..common.transport import CONNECTION, connect, new_socket, open_socket, serve
from ..common.keyring import check_private, server_keyring
from ..common.security import current_peer
from ..common.zap import run_zap
from .access import MetaAccess
from .db import DB_NAME, lock_database, open_database
from . import applied_ops
from .duties import Duties
from .events import ChangeFeed
from .metrics import cluster_health
from . import redundancy
from .health import NodeRegistry, Sessions
from .housekeeping import Housekeeping
from .namespace import Namespace, to_attr
from .namespace_bulk import NewFile, create_many, unlink_many
from .quota_service import QuotaService
from .snapshot_service import SnapshotService
from .snapshots import check_writable
from .trash_service import TrashService
from .repair import Healer
from .repair_admin import OperatorRequests
from .open_holds import OpenHolds
from .shared_holds import SharedHolds
from .pg_store import open_pg_store
from .store import SqliteStore
from .tiering import Tiering
from .txn import Txn, acting_client, open_txn
from .burst import Burst, Op, TaskNeeded
from .read_lane import ReadLane
from .callbacks import Callbacks
from .inode_ranges import InodeRanges

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how long a node that registers has to answer the daemon's ping
NODE_PING_TIMEOUT_S = 2.0
#: the requests served without a task of their own (daemon/burst.py): their ``_op_<tag>`` is the operation
BURST_KINDS = frozenset({
    P.LookupReq, P.GetattrReq, P.CreateReq, P.MknodReq, P.MkdirReq, P.SymlinkReq, P.LinkReq, P.UnlinkReq,
    P.RmdirReq, P.RenameReq, P.SetattrReq, P.CommitReq,
    # a write session's bookkeeping (issue 35: a task each cost the daemon ~1 ms, ~0.5 of the model
    # tester's requests per operation): an open, its epoch, its placements and their release
    P.OpenReq, P.AllocEpochReq, P.AllocChunksReq, P.ReleaseChunksReq,
})
#: operations that may have to copy a snapshot's shared chunks out before they apply (daemon/snapshot_service.py)
GATED_KINDS = frozenset({P.SetattrReq, P.CommitReq})
#: lookups a LookupPathsReq makes per hold of the lock (handle_lookup_paths): about 10 ms of work,
#: the most another request waits behind one connection's batches
LOOKUP_SLICE = 512


def _result(result, _dirs, _seq) -> P.Msg:
    return result


def _attr_reply(attr, dirs, seq) -> P.Msg:
    return P.AttrRsp(attr=attr, dir_attrs=dirs, seq=seq)


def _changed_reply(_, dirs, seq) -> P.Msg:
    return P.ChangedRsp(dir_attrs=dirs, seq=seq)


def _handlers(owners) -> dict[type, Callable]:
    """Request class -> the ``handle_<tag>`` method of the owner defining it."""
    handlers: dict[type, Callable] = {}
    for cls in P.Request.__args__:
        for owner in owners:
            handler = getattr(owner, f"handle_{cls.__struct_config__.tag}", None)
            if handler is not None:
                handlers[cls] = handler
    return handlers


class MetaService:
    """One metadata daemon: ``await nursery.start(service.run)``, then it serves until cancelled."""

    def __init__(self, config: MetaConfig, *, zmq_context: zmq.Context | None = None):
        self.config = config
        self.ctx = zmq_context
        self.boot_id = uuid.uuid4().hex
        self.db_path = Path(config.data_dir) / DB_NAME
        self.store: SqliteStore | None = None
        self.ns: Namespace | None = None
        self.nodes: NodeRegistry | None = None
        self.sessions = Sessions(config.session_lease_s, config.max_open_per_session, config.max_sessions_per_key)
        self.txn: Txn | None = None  # the lock, savepoints, group commit (daemon/txn.py); set by open()
        self.housekeeping: Housekeeping | None = None  # health sweep, collector, feed poll, trims; set by open()
        # built by open(), with the database: they get the transaction engine, the store and the node table
        self.healer: Healer | None = None  # re-replication, drain, bad copies (daemon/repair.py)
        self.operator: OperatorRequests | None = None  # node administration, scrub, fsck (daemon/repair_admin.py)
        self.quota_service: QuotaService | None = None  # directory quotas (daemon/quota.py)
        self.trash_service: TrashService | None = None  # the trash (daemon/trash.py)
        self.snapshot_service: SnapshotService | None = None  # snapshots (daemon/snapshots.py)
        self.access: MetaAccess | None = None  # keys, roles, read-only, subtrees (daemon/access.py)
        self.holds: OpenHolds | None = None  # PostgreSQL: open files across daemons (daemon/open_holds.py)
        self.tiering: Tiering | None = None  # the cold tier on object storage (daemon/tiering.py)
        # which requests are served (the classes' handle_* methods); bound to the objects by open()
        self._handlers: dict[type, Callable] = _handlers(
            (self, Healer, OperatorRequests, QuotaService, MetaAccess, Tiering, TrashService, SnapshotService)
        )
        self._path_batches: dict[bytes, list] = {}  # connection -> its LookupPathsReq line (handle_lookup_paths)
        self.feed: ChangeFeed | None = None
        self.duties: Duties | None = None  # set by open(): whether this daemon runs the cluster duties
        self.burst: Burst | None = None  # the request path without a task per request, set by run()
        self.lane: ReadLane | None = None  # lone reads on a thread of their own (SQLite), set by run()
        self.read_port = 0  # the read lane's port (PingRsp.read_port), set by run(); 0: none
        self._op_methods = {cls: getattr(self, f"_op_{cls.__struct_config__.tag}") for cls in BURST_KINDS}  # operation()

    # -- lifecycle -----------------------------------------------------------

    def open(self) -> None:
        """Open the database and build the in-memory state (done by ``run``; tests may call it)."""
        from ..common.protocol import Layout

        if self.config.tier_credentials:  # the cold tier's secret, as CURVE secret files are
            check_private(self.config.tier_credentials, "tier_credentials")

        layout = Layout(
            chunk_size=int(self.config.chunk_size),
            stripe_count=self.config.stripe_count,
            redundancy=self.config.redundancy,
        )
        self._db_lock = None
        if self.config.store == "postgresql":
            self.store = open_pg_store(self.config.dsn, layout, pool_size=self.config.pool_size)
        else:
            self._db_lock = lock_database(self.db_path)  # released when this process exits
            self.store = SqliteStore(open_database(self.db_path, layout))
        self.cluster_id = self.store.get_meta("cluster_id")
        if self.cluster_id is None:  # a database from before cluster ids, or a new one
            self.cluster_id = uuid.uuid4().hex
            # autocommit, outside the service's transaction; with several daemons starting at once the first one's wins
            self.cluster_id = self.store.init_meta("cluster_id", self.cluster_id)
        self.txn = open_txn(
            self.store, self.config, name=str(self.db_path),
            on_write=self._written, on_commit=self._committed, on_rollback=lambda: self.ns.quotas.reload(),
        )
        store, txn = self.store, self.txn
        nodes = self.nodes = NodeRegistry(store, self.config.node_timeout_s, self.config.node_suspect_s)
        self.duties = Duties(f"{self.config.listen}#{self.boot_id[:8]}", shared=not store.group_commit)
        # several daemons (PostgreSQL): a file is open if a session of any of them holds it
        if not store.group_commit:
            self.holds = OpenHolds(
                txn, store, self.sessions, self.boot_id, lease_s=self.config.session_lease_s, duties=self.duties,
                wake_gc=self._wake_gc,
            )
        # one daemon (SQLite): mounts may cache regular files under callbacks, which count as open;
        # several (PostgreSQL): directories only, held through rows others see (daemon/shared_holds.py),
        # as of this daemon's feed (every change at or below it committed before the grant began)
        self.callbacks = Callbacks(enabled=True, alive=self.sessions.alive, owner=self.sessions.owner_of,
                                   last_seq=(lambda: txn.last_seq) if store.group_commit else self._feed_seq)
        self.callbacks.files = store.group_commit
        self.shared: SharedHolds | None = None
        if store.group_commit:
            txn.after_change = self._settle
        else:
            self.shared = SharedHolds(txn, store, self.callbacks, self.boot_id)
            txn.after_change = self._settle_shared
            txn.position = self._feed_seq  # what reported directory attributes are as of
        self.ns = Namespace(store, nodes, is_open=self.holds.is_open if self.holds else self._open_or_held)
        self.ns.trash.keep_ns = int(self.config.trash_keep_s * 1e9)  # removals kept this long (daemon/trash.py)
        self.healer = Healer(
            self.config, txn, store, nodes, ns=self.ns, sessions=self.sessions, duties=self.duties,
            wake_gc=self._wake_gc, ctx=self.ctx,
        )
        self.operator = OperatorRequests(self.healer, txn, store, nodes)
        self.quota_service = QuotaService(txn, store, self.ns)
        self.access = MetaAccess(txn, store, nodes, self.ns, self.sessions)
        self.housekeeping = Housekeeping(
            self.config, txn, store, nodes, ns=self.ns, sessions=self.sessions, duties=self.duties, healer=self.healer,
            feed_views=self.access.feed_views, ctx=self.ctx, callbacks=self.callbacks,
        )
        self.inode_ranges = self.housekeeping.inode_ranges = InodeRanges(store, grace_s=self.config.session_lease_s,
                                                                         shared=not store.group_commit)  # asynchronous creates' numbers
        self.inode_ranges.load()
        self.tiering = Tiering(
            self.config, txn, store, nodes, ns=self.ns, sessions=self.sessions, duties=self.duties, healer=self.healer,
            cluster_id=self.cluster_id, wake_gc=self.housekeeping.wake_node_gc,  # node copies it released or wrote
        )
        self.housekeeping.gc_listeners.append(self.tiering.wake_collector)  # objects of deleted files
        self.trash_service = TrashService(txn, self.ns, wake_gc=self._wake_gc)
        self.ns.snapshots.load()
        self.snapshot_service = SnapshotService(
            txn, self.ns, nodes, self.healer.clients, wake_gc=self._wake_gc, on_change=self._snapshots_changed
        )
        self._handlers = _handlers(
            (self, self.healer, self.operator, self.quota_service, self.access, self.tiering, self.trash_service,
             self.snapshot_service)
        )
        nodes.on_change = self._on_trio_thread(self.healer.node_changed)
        self.duties.on_lost.append(self.healer.stop_pass)
        txn.begin()
        log.info(
            "database %s opened: %d inode(s), %d chunk copies waiting for deletion, boot %s",
            self.db_name(), self.store.counts()["inodes"], self.store.count_garbage(), self.boot_id,
        )

    def _wake_gc(self) -> None:
        """Garbage was added: the collector runs a round soon (and the tier's, for objects of files deleted or cut)."""
        self.housekeeping.wake_gc()

    def _open_or_held(self, ino: int) -> bool:
        """A session has it open, or may open it without asking (a callback, daemon/callbacks.py)."""
        return self.sessions.is_open(ino) or self.callbacks.held(ino)

    async def _settle(self, seq: int, inodes: list[int], entries: list, writer: int) -> None:
        """A change is durable: wait for the mounts caching what it touched (daemon/callbacks.py)."""
        freed = await self.callbacks.settle(seq, inodes, entries, writer=writer)
        await self.housekeeping.release(freed)

    async def _settle_shared(self, seq: int, inodes: list[int], entries: list, writer: int, holders: list = ()) -> None:
        """A change is committed (several daemons): wait for the directory holds it found (daemon/shared_holds.py)."""
        if holders:
            await self.shared.wait_for(holders)

    @staticmethod
    def _settle_now_shared(seq: int, inodes: list[int], entries: list, writer: int, holders: list = ()) -> list[int] | None:
        """``Callbacks.settle_now`` for several daemons: None when the change found holds to wait for."""
        return None if holders else []

    def _feed_seq(self) -> int:
        """The position of this daemon's feed: what a grant is as of (several daemons)."""
        return self.feed.seq if self.feed is not None else self.txn.last_seq

    def _on_trio_thread(self, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` run on the trio thread even when called from a PostgreSQL worker thread (it wakes trio tasks)."""
        trio_thread = threading.get_ident()

        def call(*args) -> None:
            if threading.get_ident() == trio_thread:
                fn(*args)
            else:
                trio.from_thread.run_sync(fn, *args)

        return call

    def db_name(self) -> str:
        """Where the metadata lives, for log lines: the SQLite file, or "PostgreSQL"."""
        return str(self.db_path) if self.store is None or self.store.group_commit else "PostgreSQL"

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        own_ctx = self.ctx is None
        if own_ctx:
            self.ctx = zmq.Context()
        self.open()
        try:
            async with contextlib.AsyncExitStack() as stack:
                await self._start_curve(stack)
                sock = await stack.enter_async_context(open_socket(self.ctx, zmq.ROUTER, bind=self.config.listen))
                read_sock = None
                if self.store.group_commit and self.config.read_listen != "off":  # SQLite: the read lane's (_serve_requests)
                    read_sock = new_socket(self.ctx, zmq.ROUTER, bind=self._read_address())
                    stack.callback(lambda: read_sock.closed or self.lane is not None or read_sock.close(linger=0))  # not handed over
                    self.read_port = int(read_sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
                log_id, last_seq = self.store.get_meta("change_log_id"), self.store.last_change_seq()
                self.feed = ChangeFeed(self.ctx, self._events_address(), log_id, last_seq, self.access.keyring, daemon=self.boot_id)
                # answers granted before this daemon logs its first change are as of the log's end, not
                # of 0 (which a mount cannot tell from "no position": client/dir_attrs.py keeps nothing)
                self.txn.last_seq = max(self.txn.last_seq, last_seq or 0)
                if last_seq and self.store.group_commit:  # a restart: mounts may still cache under callbacks
                    self.callbacks.start_grace()          # this daemon never heard of (PostgreSQL: dir_holds rows)
                stack.push_async_callback(self._close_feed)  # after the nursery below: no task writes any more
                housekeeping = self.housekeeping
                housekeeping.feed = self.feed
                nursery = await stack.enter_async_context(trio.open_nursery())
                nursery.start_soon(self.txn.run_committer, name="meta-committer")
                nursery.start_soon(housekeeping.health_loop, name="meta-health")
                if self.holds is not None:
                    nursery.start_soon(self.holds.run, self.ns.reclaim_orphans, name="meta-open-holds")
                nursery.start_soon(self.feed.heartbeat_loop, name="meta-feed")
                if self.access.keyring is not None:  # who hears what (daemon/events.py)
                    nursery.start_soon(self.feed.subscription_loop, name="meta-feed-subscriptions")
                if not self.store.group_commit:
                    await nursery.start(self.shared.run, name="meta-shared-holds")
                    housekeeping.on_published = self.shared.published
                    nursery.start_soon(housekeeping.feed_poll_loop, name="meta-feed-poll")
                nursery.start_soon(self.duties.run, housekeeping.take_lease, housekeeping.release_lease, name="meta-lease")
                nursery.start_soon(
                    self.duties.run_while_leading,
                    [
                        (housekeeping.startup_orphan_sweep, "meta-orphans"),
                        (housekeeping.gc_loop, "meta-gc"),
                        (housekeeping.trim_loop, "meta-trim"),
                        (self.tiering.run, "meta-tiering"),
                    ],
                    name="meta-duties",
                )
                await nursery.start(self.healer.run, name="meta-repair")
                task_status.started()
                await self._serve_requests(sock, read_sock)
        finally:
            with trio.CancelScope(shield=True):
                await self.txn.commit_now()
            if self.shared is not None:  # a clean stop: no change elsewhere waits for this daemon's holds
                self.shared.forget_all()
            self.store.close()
            if self._db_lock is not None:
                self._db_lock.close()
            if own_ctx:
                self.ctx.term()
            log.info("metadata daemon stopped; database %s closed", self.db_name())

    async def _serve_requests(self, sock, read_sock) -> None:
        """Serve until cancelled: serve() with the burst path (daemon/burst.py) on ``sock``; on
        SQLite also the read lane (daemon/read_lane.py) on ``read_sock``, whose thread answers lone
        reads that need nothing of trio, the rest as the main socket's (rare: a change waits for its
        commit, a recall, a grant)."""
        burst = self._burst()
        async with trio.open_nursery() as nursery:
            if read_sock is not None:
                self.lane = ReadLane(self, self.db_path)
                nursery.start_soon(self._serve_read_lane, read_sock, burst)
            await serve(sock, self.handle, concurrency=256, name="meta", limits=self.config.serve_limits(), burst=burst)

    async def _serve_read_lane(self, read_sock, burst) -> None:
        try:  # what the lane forwards takes the burst path too: a connection's requests in order, as on the main socket
            await serve_with_fast_lane(self.ctx, read_sock, self.handle, self.lane.fast, name="meta-read",
                                       limits=self.config.serve_limits(), ordered=True, tell_waiting=False,
                                       concurrency=64, burst=burst)
        finally:
            self.lane.close()

    async def _close_feed(self) -> None:
        """On the way out: the batch still waiting for its group commit is committed, and so
        published, while the feed can still tell the mounts; then the feed closes (a commit after
        this publishes nothing: ``_committed``)."""
        with trio.CancelScope(shield=True):
            await self.txn.commit_now()
        feed, self.feed = self.feed, None
        feed.close()

    async def _start_curve(self, stack: contextlib.AsyncExitStack) -> None:
        """With curve_key/keyring: this daemon's key on every socket, and ZAP admitting the keyring's keys."""
        listen = [self.config.listen, self._events_address(), "" if self.config.read_listen == "off" else self._read_address()]
        self.access.keyring = server_keyring(self.ctx, self.config.curve_key, self.config.keyring, listen)
        self.access.caps = capability.load(self.config.cap_secret, self.config.cap_ttl_s)  # subtree keys' capabilities
        if self.access.keyring is not None:
            zap = await stack.enter_async_context(trio.open_nursery())
            stack.callback(zap.cancel_scope.cancel)
            await zap.start(run_zap, self.ctx, self.access.keyring.accepts)

    def _read_address(self) -> str:
        """Where the read lane listens (daemon/read_lane.py): ``read_listen``, else the interface of
        ``listen`` on a free port (told to mounts in PingRsp.read_port)."""
        if self.config.read_listen:
            return self.config.read_listen
        return self.config.listen.rsplit(":", 1)[0] + ":0"

    def _events_address(self) -> str:
        if self.config.events_listen:
            return self.config.events_listen
        return self.config.listen.rsplit(":", 1)[0] + ":0"  # same interface, any free port

    async def handle(self, body: P.Msg, payloads: list) -> P.Msg:
        handler = self._handlers.get(type(body))
        if handler is None:
            raise StripefsError(ErrorCode.UNKNOWN_MESSAGE, f"the metadata daemon does not serve {type(body).__name__}")
        try:
            return await self.access.handle(body, handler)
        except OverflowError as exc:  # SQLite stores signed 64-bit integers: a number from the wire was out of range
            log.warning("refusing %s: a number is out of range: %s", type(body).__name__, exc)
            raise StripefsError(ErrorCode.BAD_REQUEST, f"a number in {type(body).__name__} is out of range (signed 64-bit)") from None

    # -- transactions (daemon/txn.py) ----------------------------------------------

    def _reporting(self, inodes: list[int]) -> Callable[[], list[P.Attr]]:
        """The attributes of directories ``inodes`` right after an operation (client/dir_attrs.py)."""
        return functools.partial(self._dir_attrs, inodes)

    async def _perform(self, op: Op) -> P.Msg:
        """A request's operation (``operation``) on the usual path, a task of its own: a read,
        or a write returning once durable (txn.write_reporting)."""
        if not op.write:
            return op.reply(await self.txn.read(op.fn), [], 0)
        result, dirs, seq = await self.txn.write_reporting(op.fn, report=op.report, change=op.change)
        return op.reply(result, dirs, seq)

    def operation(self, body: P.Msg) -> Op:
        """The operation of a request of ``BURST_KINDS`` (its ``_op_<tag>``): what the burst path
        (daemon/burst.py) and the handler both run. Checks made before the operation
        (a session's owner, a write fence) are made here, and raise."""
        return self._op_methods[type(body)](body)

    def _burst(self) -> Callable:
        """serve()'s burst path (daemon/burst.py): one group commit (SQLite) or one transaction
        (PostgreSQL) per burst."""
        self.burst = Burst(
            txn=self.txn, access=self.access, kinds=BURST_KINDS, operation=self.operation,
            settle_now=self.callbacks.settle_now if self.shared is None else self._settle_now_shared,
            settle=self._settle if self.shared is None else self._settle_shared, release=self.housekeeping.release,
            redo=lambda request: self.handle(request, []), defer=self._must_recall, create_many=self._create_many,
            unlink_many=functools.partial(unlink_many, self.ns), commits_run=lambda: not self.ns.quotas.roots,
        )
        self._snapshots_changed()
        return self.burst.run

    def _snapshots_changed(self) -> None:
        """While snapshots exist, commits and setattrs take the task path: one may have to copy a
        shared chunk out first (daemon/snapshot_service.py ``gated``), which waits on storage nodes."""
        if self.burst is not None:
            self.burst.kinds = BURST_KINDS - GATED_KINDS if self.ns.snapshots.count else BURST_KINDS

    def _written(self) -> None:
        """After every write: redundancy figures in status are recomputed, and a shared
        database publishes the change now, not at the next poll."""
        self.healer.stale = True
        self.housekeeping.wake_feed()

    def _committed(self) -> None:
        """SQLite: a batch is durable; tell the mounts before the replies go."""
        if self.feed is not None:
            self.feed.publish_new(self.store, self.access.feed_views)

    def _dir_attrs(self, inodes) -> list[P.Attr]:
        """Attributes of these directories now (under ``_lock``, right after an operation); [] if one is gone."""
        try:
            return [self.ns.getattr(ino) for ino in dict.fromkeys(inodes)]
        except StripefsError:
            return []

    # -- generic and nodes -------------------------------------------------------

    async def handle_ping(self, req: P.PingReq) -> P.Msg:
        return P.PingRsp(
            role="meta",
            boot_id=self.boot_id,
            events_port=self.feed.port if self.feed else 0,
            events_seq=self.feed.seq if self.feed else 0,
            events_log=self.feed.boot_id if self.feed else "",
            read_port=self.read_port,
        )

    async def handle_once(self, req: P.OnceReq) -> P.Msg:
        """A mutating request applied at most once however often it is retried (daemon/applied_ops.py)."""
        name = type(req.body).__name__
        if name not in P.ONCE_MESSAGES:
            raise StripefsError(ErrorCode.BAD_REQUEST, f"{name} cannot be wrapped in OnceReq")
        client_id = applied_ops.bind(req.client_id, current_peer())  # a retry answers only the key that made it
        token = applied_ops.once.set(applied_ops.OnceKey(client_id, req.op_id, req.done_below))
        try:
            return await self.handle(req.body, [])
        finally:
            applied_ops.once.reset(token)

    async def handle_batch(self, req: P.BatchReq) -> P.Msg:
        """A BatchReq the serving loop's burst did not take: a burst of its own in this task (one
        commit or transaction, daemon/burst.py); a subtree key's, each item through ``handle`` on
        its own (its access checks, capabilities), in order; one reply."""
        if self.burst is not None:
            rsp = (await self.burst.run([(req, current_peer())]))[0]
            if callable(rsp):  # some change waits for a mount's acknowledgement
                rsp = await rsp()
            if isinstance(rsp, P.ErrorRsp):
                raise StripefsError(rsp.code, rsp.message)
            if rsp is not None:
                return rsp
        results: list[P.Msg] = []
        for item in req.items:
            inner = item.body if isinstance(item, P.OnceReq) else item
            try:
                if type(inner).__name__ not in P.BATCH_MESSAGES:
                    raise StripefsError(ErrorCode.BAD_REQUEST, f"{type(inner).__name__} cannot be in a BatchReq")
                results.append(await self.handle(item, []))
            except StripefsError as exc:
                results.append(P.ErrorRsp(code=int(exc.code), message=exc.message))
        return P.BatchRsp(results=results)

    async def handle_status(self, req: P.StatusReq) -> P.Msg:
        grant = self.access.grant()  # a subtree key sees only its own quotas, a storage key none
        counts = await self.txn.read(self.store.counts)
        health = await self.txn.read(cluster_health, self.store, self.nodes.info())
        repair = await self.healer.fresh()
        return P.StatusRsp(
            nodes=self.nodes.info(placed=self.healer.placed()),
            files=counts["files"],
            directories=counts["directories"],
            chunks=counts["chunks"],
            logical_bytes=counts["logical_bytes"],
            sessions=len(self.sessions),
            boot_id=self.boot_id,
            degraded_chunks=health["degraded_chunks"],
            garbage_copies=health["garbage_copies"],
            layouts=await self.txn.read(self._layout_usage),
            **dict(zip(("snapshots", "snapshot_bytes"), await self.txn.read(self.store.snapshot_usage))),
            under_replicated=repair.under_replicated,
            repair=self.healer.info(),
            leader=self.duties.leader,
            daemon=self.duties.holder,
            quotas=await self.txn.read(lambda: self.access.visible_quotas(grant, self.quota_service.all_info())),
            tiering=await self.tiering.status() if grant.role in ("meta", "admin") or not self.access.keyring else None,
        )

    def _layout_usage(self) -> list[P.LayoutUsage]:
        usage = redundancy.layout_usage(self.store.usage_rows())
        return [P.LayoutUsage(redundancy=r, **u) for r, u in sorted(usage.items())]

    async def handle_register_node(self, req: P.RegisterNodeReq) -> P.Msg:
        grant = self.access.grant()
        proven = True  # without CURVE a registration is trusted, as before
        if self.access.keyring is not None:  # data goes only to nodes that answered (daemon/health.py)
            proven = await self._node_answers(req.node_id, req.address)

        def register():
            with self.nodes.registering:  # other registrations ran meanwhile: the key's rights again, with it
                self.access.check_registration(grant, req)
                self.nodes.register(req, proven=proven)

        await self.txn.write(register)
        self._wake_gc()
        return P.OkRsp()

    async def _node_answers(self, node_id: int, address: str) -> bool:
        """Whether storage node ``node_id`` answers a ping at ``address`` (with the key it names)."""
        rsp, why = None, "no answer"
        try:
            async with connect(self.ctx, address, timeout=NODE_PING_TIMEOUT_S) as node:
                try:  # (inside: an error leaving the client's nursery would come wrapped in a group)
                    rsp, _ = await node.call(P.PingReq())
                except StripefsError as exc:
                    why = str(exc)
        except (QuietError, zmq.ZMQError) as exc:  # an address libzmq refuses
            why = str(exc)
        if isinstance(rsp, P.PingRsp) and rsp.role == "storage" and rsp.node_id == node_id:
            return True
        if rsp is not None:
            why = f"answered as {getattr(rsp, 'role', '?')} node {getattr(rsp, 'node_id', '?')}"
        log.warning("node %d registered %s, which does not answer as that node (%s): it takes no chunks until it "
                    "heartbeats", node_id, address, why)
        return False

    async def handle_node_heartbeat(self, req: P.NodeHeartbeatReq) -> P.Msg:
        self.nodes.heartbeat(req)
        return P.OkRsp()

    # -- sessions --------------------------------------------------------------

    async def handle_hello(self, req: P.HelloReq) -> P.Msg:
        sid = self.sessions.hello(req.host, req.pid, req.mountpoint, owner=current_peer())  # the key's own session
        client_id = applied_ops.bind(req.client_id, current_peer())  # as its OnceReqs will name it (handle_once)
        self.callbacks.hello(sid, client_id)
        return P.HelloRsp(
            session_id=sid,
            lease_s=self.config.session_lease_s,
            boot_id=self.boot_id,
            cluster_id=self.cluster_id,
            writer=P.writer_tag(client_id),
            callbacks=self.callbacks.enabled,
            marks=self.callbacks.files,
        )

    async def handle_session_heartbeat(self, req: P.SessionHeartbeatReq) -> P.Msg:
        await self.housekeeping.release(self.sessions.heartbeat(req.session_id, req.open_inodes, owner=current_peer()))
        return P.OkRsp()

    async def handle_session_end(self, req: P.SessionEndReq) -> P.Msg:
        await self.housekeeping.sessions_gone(self.sessions.end(req.session_id, owner=current_peer()))
        return P.OkRsp()

    async def handle_ack(self, req: P.AckReq) -> P.Msg:
        """A mount dropped what the feed changed up to ``req.seq`` (daemon/callbacks.py)."""
        owner = current_peer()
        self.sessions.touch(req.session_id, owner=owner)
        if req.committing:  # not an acknowledgement yet
            self.callbacks.committing(req.session_id)
            return P.OkRsp()
        for ino in req.open_inodes:  # open there without an OpenReq: held open from now on
            try:
                self.sessions.open(req.session_id, ino, owner=owner)
            except StripefsError as exc:
                if exc.code != ErrorCode.LIMIT:
                    raise
        freed = self.callbacks.ack(req.session_id, req.seq, everything=req.everything,
                                   client_id=applied_ops.bind(req.client_id, owner))
        await self.housekeeping.release(freed)
        return P.OkRsp()

    async def handle_open(self, req: P.OpenReq) -> P.Msg:
        if req.session_id:  # sessions belong to their key (daemon/health.py): checked before any mark
            self.sessions.touch(req.session_id, owner=current_peer())
        mark = None
        if req.mark and req.session_id:
            mark = await self._mark_written(req.session_id, req.ino)
        else:
            await self.callbacks.grace_over()
            await self._recall_writer(req.session_id, req.ino)
        return await self._perform(self._op_open(req, mark))

    def _op_open(self, req: P.OpenReq, mark: tuple[int, int] | None = None) -> Op:
        """The open itself: the file's open information, the session's hold on it and, to write,
        an epoch (last: a high-water mark it raises is committed with the open, never rolled back
        under a handed-out epoch). A write open is a write (its reply waits for the commit holding
        that mark); a read open a read. ``mark``: the write mark ``handle_open`` got (seq, as of);
        None with ``req.mark``: the burst's open, which grants it here (``_mark_now``), taken only
        when nothing must be recalled or told first (``_must_recall``)."""
        owner = current_peer()
        if req.session_id:
            self.sessions.touch(req.session_id, owner=owner)
        pair = bool(req.write and req.pair and self.ns.epoch_pairs)

        def open_and_hold():
            row = self.ns.inode(req.ino)
            if req.write:
                check_writable(row)  # a snapshot's file (daemon/snapshots.py)
            info = self.ns.open_info_of(row)
            quota_max = self.ns.quotas.max_size(req.ino, info[0].size)
            marked = mark
            if marked is None and req.mark and req.session_id:
                marked = self._mark_now(req.session_id, req.ino)
            if req.session_id:  # under the lock: no unlink can reclaim it in between
                self.sessions.open(req.session_id, req.ino, owner=owner, write=req.write)
            return *info, quota_max, marked or (-1, -1), self._epoch(pair) if req.write else 0

        def reply(result, _dirs, _seq):
            attr, layout, chunks, nodes, quota_max, (seq, as_of), epoch = result
            return P.OpenRsp(attr=attr, layout=layout, chunks=chunks, nodes=nodes, epoch=epoch, quota_max_size=quota_max,
                             callback=seq, seq=max(as_of, 0), epoch_pair=pair)

        return Op(open_and_hold, bool(req.write), None, None, reply)

    async def _mark_written(self, session: int, ino: int) -> tuple[int, int]:
        """A write mark on ``ino`` for ``session`` (daemon/callbacks.py): recorded first, so that any
        read after it recalls the writer; then the other sessions caching the file drop it, as for
        a change. Another writer's mark is recalled first (its data committed before this one's).
        The mark's seq (-1: none), and the change log position the answer is as of."""
        await self._recall_writer(session, ino)
        seq = self.callbacks.grant_write(session, ino)
        if seq >= 0 and self.callbacks.held_elsewhere(session, ino):
            await self._change_for(session, ino)
        return seq, self.callbacks.last_seq()

    def _mark_now(self, session: int, ino: int) -> tuple[int, int]:
        """``_mark_written`` inside an operation (the burst's open, which ``_must_recall`` leaves to
        ``handle_open`` when another session writes or caches the file). Another session that began
        caching it since (earlier in the same burst) needs the change only a task can wait for: the
        open goes to ``handle_open`` then (TaskNeeded, before it changed anything). Never no mark
        (-1) for that: a mount without one commits only as it stops writing, after its close
        returned, and the other session's next open would be answered from what it caches."""
        if self.callbacks.held_elsewhere(session, ino):
            raise TaskNeeded(f"inode {ino}: another session began caching it: its write mark waits for that cache to go")
        return self.callbacks.grant_write(session, ino), self.callbacks.last_seq()

    def _epoch(self, pair: bool = False) -> int:
        """A fresh epoch, inside an operation (its last step: nothing after it may fail); a
        high-water mark it raises is durable with the operation's commit (``txn.epoch_raised``)."""
        epoch, raised = self.ns.alloc_epoch(pair=pair)
        if raised:
            self.txn.epoch_raised()
        return epoch

    async def _recall_writer(self, session: int, ino: int) -> None:
        """Another session writes ``ino`` with closes that send nothing: it commits before this read
        (a change naming the file, which waits for it: daemon/callbacks.py, write marks)."""
        if self.callbacks.written_elsewhere(session, ino):
            await self._change_for(session, ino)

    async def _change_for(self, session: int, ino: int) -> None:
        """Log a change naming ``ino`` (nothing else changes) on ``session``'s behalf: it waits for every
        other session holding the file, not for ``session`` itself."""
        token = acting_client.set(self.callbacks.client_of(session))
        try:
            await self.txn.write(_nothing, change=([ino], []))
        finally:
            acting_client.reset(token)

    async def handle_close(self, req: P.CloseReq) -> P.Msg:
        await self.housekeeping.release(self.sessions.close(req.session_id, req.ino, owner=current_peer()))
        return P.OkRsp()

    # -- namespace -------------------------------------------------------------

    async def handle_lookup(self, req: P.LookupReq) -> P.Msg:
        await self.callbacks.grace_over()
        if self.shared is not None:  # the holders may be other daemons' (daemon/shared_holds.py)
            await self.shared.recall(req.session_id, req.parent, req.name, child=True)
            return await self._perform(self._op_lookup(req))
        await self._recall(req.session_id, req.parent, req.name)
        child = self._held_child(req)
        if child:
            await self._recall(req.session_id, child, b"")
            await self._recall_writer(req.session_id, child)
        return await self._perform(self._op_lookup(req))

    def _held_child(self, req: P.LookupReq) -> int:
        """What ``req`` finds, if another session creates in it asynchronously (a directory) or writes
        it with closes that send nothing (a file): its attributes come with the answer, so it is
        recalled first; else 0."""
        marks = self.callbacks.marks
        if not (marks or self.inode_ranges.others(req.session_id)):
            return 0
        row = self.store.get_dentry(req.parent, req.name)
        ino = row["ino"] if row is not None else 0
        if not ino:
            return 0
        if marks and self.callbacks.written_elsewhere(req.session_id, ino):
            return ino
        return ino if self.callbacks.recall_needed(req.session_id, ino, self.inode_ranges.holds) else 0

    def _must_recall(self, body: P.Msg) -> bool:
        """A lookup, getattr or open the burst must leave to its handler: it recalls a directory or a
        writer first, waits the grace after a restart out (daemon/callbacks.py), or marks the file
        written (an open with ``mark``)."""
        kind = type(body)
        if kind is P.OpenReq:  # a writer to recall, or (to mark it) a cache elsewhere to drop first: handle_open;
            # a shared database's marks too (its burst runs in a worker thread; the callbacks are trio's)
            marking = bool(body.mark and body.session_id)
            return self.callbacks.in_grace() or self.callbacks.written_elsewhere(body.session_id, body.ino) \
                or (marking and (self.shared is not None or self.callbacks.held_elsewhere(body.session_id, body.ino)))
        if kind is P.LookupReq:
            return self.callbacks.in_grace() or self.callbacks.recall_needed(body.session_id, body.parent, self.inode_ranges.holds) \
                or bool(self._held_child(body))
        return kind is P.GetattrReq and (self.callbacks.in_grace()
                                         or self.callbacks.recall_needed(body.session_id, body.ino, self.inode_ranges.holds)
                                         or self.callbacks.written_elsewhere(body.session_id, body.ino))

    async def _recall(self, session: int, parent: int, name: bytes) -> None:
        """Another session holds directory ``parent`` whole and may have answered creates there
        that this daemon has not got yet (client/async_dirops.py): a change naming the directory
        makes it send them and let go before this read (daemon/callbacks.py ``recall_needed``)."""
        if self.shared is not None:
            await self.shared.recall(session, parent, name)
        elif self.callbacks.recall_needed(session, parent, self.inode_ranges.holds):
            await self.txn.write(_nothing, change=([], [(parent, name)]))

    def _op_lookup(self, req: P.LookupReq) -> Op:
        return Op(functools.partial(self._lookup, req), False, None, None, _result)

    def _lookup(self, req: P.LookupReq) -> P.Msg:
        if not req.open_info:
            attr = self.ns.lookup(req.parent, req.name)
            return P.AttrRsp(attr=attr, callback=self._grant(req, attr))
        owner = current_peer()
        if req.session_id:
            self.sessions.touch(req.session_id, owner=owner)
        row = self.ns.lookup_row(req.parent, req.name)
        if not stat.S_ISREG(row["mode"]):
            return P.AttrRsp(attr=to_attr(row))
        attr, layout, chunks, nodes = self.ns.open_info_of(row)
        if req.session_id:  # under the lock, as for OpenReq: no unlink can reclaim it in between
            try:
                self.sessions.open(req.session_id, attr.ino, owner=owner)
            except StripefsError as exc:
                if exc.code != ErrorCode.LIMIT:
                    raise
                return P.AttrRsp(attr=attr)  # the session holds all it may: no open information (the open is told why)
        quota_max = self.ns.quotas.max_size(attr.ino, attr.size, req.parent)
        return P.OpenRsp(attr=attr, layout=layout, chunks=chunks, nodes=nodes, quota_max_size=quota_max,
                         callback=self._grant(req, attr))

    def _grant(self, req: P.LookupReq, attr: P.Attr) -> int:
        """A callback on a regular file for the asking session, if it asked (daemon/callbacks.py); its seq or -1."""
        if not (req.callback and req.session_id and self.callbacks.enabled and stat.S_ISREG(attr.mode)):
            return -1
        self.sessions.touch(req.session_id, owner=current_peer())  # the session is the asking key's
        return self.callbacks.grant(req.session_id, attr.ino, req.parent, req.name)

    async def handle_lookup_paths(self, req: P.LookupPathsReq) -> P.Msg:
        """Resolve the paths in slices of about ``LOOKUP_SLICE`` lookups, each under the lock on its own,
        and one LookupPathsReq of a connection at a time (its others wait their turn): a connection's
        batches delay the other requests by one slice at most, never by all of its batches (review,
        issue 20: 64 batches of 4,096 paths made another mount's getattr wait 26 s). A request naming
        more than ``MAX_LOOKUP_NAMES`` names in all is refused before any lookup."""
        # ENAMETOOLONG for a path (None): not resolvable, like a missing one
        paths = [None if len(path) >= P.PATH_MAX else [n for n in path.split(b"/") if n] for path in req.paths]
        names = sum(len(path) for path in paths if path is not None)
        if names > P.MAX_LOOKUP_NAMES:
            log.warning("refusing a LookupPathsReq of %d paths naming %d names (at most %d)", len(paths), names, P.MAX_LOOKUP_NAMES)
            raise StripefsError(ErrorCode.BAD_REQUEST, f"{names} path components in one LookupPathsReq; at most {P.MAX_LOOKUP_NAMES}")
        files: list[P.OpenRsp | None] = []
        await self.callbacks.grace_over()
        async with self._one_per_connection(self._path_batches):
            while len(files) < len(paths):
                files += await self.txn.read(self._resolve_paths, req.root, paths, len(files))
        return P.LookupPathsRsp(files=files)

    def _resolve_paths(self, root: int, paths: list[list[bytes] | None], start: int) -> list[P.OpenRsp | None]:
        """The files of ``paths[start:]``, as many paths as fit in ``LOOKUP_SLICE`` lookups (one at least)."""
        files: list[P.OpenRsp | None] = []
        work = 0
        for names in itertools.islice(paths, start, None):
            cost = len(names or ()) + 1  # the names, and the file's open information
            if files and work + cost > LOOKUP_SLICE:
                break
            work += cost
            if names is None:
                files.append(None)
                continue
            try:
                ino = root
                for name in names:
                    ino = self.ns.lookup(ino, name).ino
                attr, layout, chunks, nodes = self.ns.open_info(ino)
                regular = stat.S_ISREG(attr.mode)
                files.append(P.OpenRsp(attr=attr, layout=layout, chunks=chunks, nodes=nodes) if regular else None)
            except StripefsError:  # missing, or not a regular file
                files.append(None)
        return files

    @contextlib.asynccontextmanager
    async def _one_per_connection(self, lines: dict[bytes, list]):
        """Requests of one connection (transport.CONNECTION) under this in turn, one at a time."""
        connection = CONNECTION.get()
        line = lines.get(connection)
        if line is None:
            line = lines[connection] = [trio.Lock(), 0]  # the lock, and how many hold it or wait for it
        line[1] += 1
        try:
            async with line[0]:
                yield
        finally:
            line[1] -= 1
            if not line[1]:
                del lines[connection]  # a connection with nothing waiting costs nothing

    async def handle_getattr(self, req: P.GetattrReq) -> P.Msg:
        await self.callbacks.grace_over()
        await self._recall(req.session_id, req.ino, b"")
        await self._recall_writer(req.session_id, req.ino)
        return await self._perform(self._op_getattr(req))

    def _op_getattr(self, req: P.GetattrReq) -> Op:
        return Op(functools.partial(self.ns.getattr, req.ino), False, None, None, lambda attr, _, __: P.AttrRsp(attr=attr))

    async def handle_setattr(self, req: P.SetattrReq) -> P.Msg:
        return await self.snapshot_service.gated(lambda: self._perform(self._op_setattr(req)))

    def _op_setattr(self, req: P.SetattrReq) -> Op:
        fn = functools.partial(
            self.ns.setattr, req.ino, mode=req.mode, uid=req.uid, gid=req.gid, size=req.size,
            atime_ns=req.atime_ns, mtime_ns=req.mtime_ns, ctime_ns=req.ctime_ns, chunks=req.chunks,
        )

        def reply(attr, dirs, seq):
            if req.size is not None:
                self._wake_gc()
            return P.AttrRsp(attr=attr, dir_attrs=[a for a in dirs if stat.S_ISDIR(a.mode)], seq=seq)

        return Op(fn, True, self._reporting([req.ino]), ([req.ino], []), reply)

    def _op_create(self, req: P.CreateReq) -> Op:
        owner = current_peer()
        if req.session_id:
            self.sessions.touch(req.session_id, owner=owner)

        def create_and_open():
            if req.new_ino:  # a number delegated to the session (an asynchronous create: daemon/inode_ranges.py)
                self.inode_ranges.check(req.session_id, req.new_ino)
            info, _ = self.ns.create_open(req.parent, req.name, req.mode, req.uid, req.gid, req.exclusive, ino=req.new_ino)
            return self._opened(req, info, owner)

        def reply(result, dirs, seq):
            attr, layout, chunks, nodes, quota_max, epoch = result
            callback = -1
            if req.callback and req.session_id and self.callbacks.enabled:  # it writes the file: its stat stays local
                callback = self.callbacks.grant(req.session_id, attr.ino, req.parent, req.name)
            return P.OpenRsp(
                attr=attr, layout=layout, chunks=chunks, nodes=nodes, epoch=epoch, quota_max_size=quota_max, dir_attrs=dirs, seq=seq,
                callback=callback,
            )

        return Op(create_and_open, True, self._reporting([req.parent]), ([req.parent], [(req.parent, req.name)]), reply)

    def _opened(self, req: P.CreateReq, info: tuple, owner: str | None) -> tuple:
        """The rest of a create whose file ``info`` (``open_info``) exists now: its delegated number
        spent, its quota room, the session's hold, a write epoch; the operation's result."""
        ino = info[0].ino
        if req.new_ino:
            self.inode_ranges.spent(req.session_id, ino)
        info = (*info, self.ns.quotas.max_size(ino, info[0].size, req.parent))
        if req.session_id:
            self.sessions.open(req.session_id, ino, owner=owner, write=True)
        return (*info, self._epoch())  # last: nothing after it can fail

    def _create_many(self, reqs: list[P.CreateReq]) -> list:
        """A run of exclusive CreateReqs of one directory as one operation (daemon/burst.py
        ``_many``, daemon/namespace_bulk.py): each one's result as ``_op_create``'s operation
        returns it, or its StripefsError, in order."""
        owner = current_peer()
        out: list = [None] * len(reqs)
        files, index = [], []
        for i, req in enumerate(reqs):
            if req.new_ino:
                try:
                    self.inode_ranges.check(req.session_id, req.new_ino)
                except StripefsError as exc:
                    out[i] = exc
                    continue
            files.append(NewFile(req.name, req.mode, req.uid, req.gid, req.new_ino))
            index.append(i)
        for i, info in zip(index, create_many(self.ns, reqs[0].parent, files)):
            out[i] = info if isinstance(info, StripefsError) else self._opened(reqs[i], info, owner)
        return out

    async def handle_create(self, req: P.CreateReq) -> P.Msg:
        return await self._perform(self._op_create(req))

    def _op_mknod(self, req: P.MknodReq) -> Op:
        fn = functools.partial(self.ns.mknod, req.parent, req.name, req.mode, req.rdev, req.uid, req.gid)
        return Op(fn, True, self._reporting([req.parent]), ([req.parent], [(req.parent, req.name)]), _attr_reply)

    async def handle_mknod(self, req: P.MknodReq) -> P.Msg:
        return await self._perform(self._op_mknod(req))

    def _op_mkdir(self, req: P.MkdirReq) -> Op:
        owner = current_peer()
        # several daemons: the new directory's hold is a row written with it, the grant as of a
        # position read before its transaction (daemon/shared_holds.py)
        shared = self.shared if req.callback and req.session_id and self.shared is not None else None
        if shared is not None:
            self.sessions.touch(req.session_id, owner=owner)  # the session is the asking key's
            if not self.callbacks.may_hold_dir(req.session_id):
                shared = None
        as_of, grant = self._feed_seq(), [0]

        def fn():
            if req.new_ino:  # as in _op_create
                self.sessions.touch(req.session_id, owner=owner)
                self.inode_ranges.check(req.session_id, req.new_ino)
            attr = self.ns.mkdir(req.parent, req.name, req.mode, req.uid, req.gid, ino=req.new_ino)
            if req.new_ino:
                self.inode_ranges.spent(req.session_id, req.new_ino)
            if shared is not None:
                grant[0] = shared.hold_row(attr.ino, req.session_id)
            return attr

        def reply(attr, dirs, seq):
            callback = -1
            if shared is not None:
                if grant[0]:
                    callback = shared.granted(attr.ino, req.session_id, grant[0], as_of)
            elif req.callback and req.session_id and self.callbacks.enabled and self.shared is None:
                self.sessions.touch(req.session_id, owner=current_peer())  # the session is the asking key's
                callback = self.callbacks.grant_dir(req.session_id, attr.ino)  # it knows every name in it: none
            return P.AttrRsp(attr=attr, dir_attrs=dirs, seq=seq, callback=callback)

        return Op(fn, True, self._reporting([req.parent]), ([req.parent], [(req.parent, req.name)]), reply)

    async def handle_mkdir(self, req: P.MkdirReq) -> P.Msg:
        return await self._perform(self._op_mkdir(req))

    def _op_symlink(self, req: P.SymlinkReq) -> Op:
        fn = functools.partial(self.ns.symlink, req.parent, req.name, req.target, req.uid, req.gid)
        return Op(fn, True, self._reporting([req.parent]), ([req.parent], [(req.parent, req.name)]), _attr_reply)

    async def handle_symlink(self, req: P.SymlinkReq) -> P.Msg:
        return await self._perform(self._op_symlink(req))

    def _op_link(self, req: P.LinkReq) -> Op:
        change = ([req.ino, req.new_parent], [(req.new_parent, req.new_name)])
        fn = functools.partial(self.ns.link, req.ino, req.new_parent, req.new_name)
        return Op(fn, True, self._reporting([req.new_parent]), change, _attr_reply)

    async def handle_link(self, req: P.LinkReq) -> P.Msg:
        return await self._perform(self._op_link(req))

    def _op_unlink(self, req: P.UnlinkReq) -> Op:
        # the file itself changed too (nlink): holders of it are waited for, and an orphan's go
        change = lambda _: ([req.parent, *self.ns.take_unlinked()], [(req.parent, req.name)])  # noqa: E731
        fn = functools.partial(self.ns.unlink, req.parent, req.name)
        return Op(fn, True, self._reporting([req.parent]), change, self._changed_gc)

    async def handle_unlink(self, req: P.UnlinkReq) -> P.Msg:
        return await self._perform(self._op_unlink(req))

    def _op_rmdir(self, req: P.RmdirReq) -> Op:
        fn = functools.partial(self.ns.rmdir, req.parent, req.name)
        return Op(fn, True, self._reporting([req.parent]), ([req.parent], [(req.parent, req.name)]), _changed_reply)

    async def handle_rmdir(self, req: P.RmdirReq) -> P.Msg:
        return await self._perform(self._op_rmdir(req))

    def _op_rename(self, req: P.RenameReq) -> Op:
        # a file the rename replaced changed too (nlink), as for an unlink
        entries = [(req.parent_old, req.name_old), (req.parent_new, req.name_new)]
        change = lambda _: ([req.parent_old, req.parent_new, *self.ns.take_unlinked()], entries)  # noqa: E731
        fn = functools.partial(self.ns.rename, req.parent_old, req.name_old, req.parent_new, req.name_new, req.flags)
        return Op(fn, True, self._reporting([req.parent_old, req.parent_new]), change, self._changed_gc)

    async def handle_rename(self, req: P.RenameReq) -> P.Msg:
        return await self._perform(self._op_rename(req))

    def _changed_gc(self, _, dirs, seq) -> P.Msg:
        self._wake_gc()
        return P.ChangedRsp(dir_attrs=dirs, seq=seq)

    async def handle_readlink(self, req: P.ReadlinkReq) -> P.Msg:
        return P.ReadlinkRsp(target=await self.txn.read(self.ns.readlink, req.ino))

    async def handle_readdir(self, req: P.ReaddirReq) -> P.Msg:
        await self.callbacks.grace_over()
        await self._recall(req.session_id, req.ino, b"")
        def wanted(attr, layout) -> bool:
            return not (req.small_only and (attr.size > MAX_CHUNK_SIZE or attr.size > layout.chunk_size))

        def list_dir():
            files = []
            if req.open_info:  # the files' rows come with the listing, their chunks in one query
                entries, more, infos = self.ns.readdir_open_info(req.ino, req.after, req.limit, wanted)
                files = [P.OpenRsp(attr=attr, layout=layout, chunks=chunks, nodes=nodes)
                         for attr, layout, chunks, nodes in infos]
            else:
                entries, more = self.ns.readdir(req.ino, req.after, req.limit)
            callback = whole = -1
            if shared:  # several daemons: no file callbacks; the directory's hold is a row (below)
                if req.after == 0 and not more:
                    whole = self.shared.hold_row(req.ino, req.session_id)
            elif req.callback and req.session_id and self.callbacks.enabled and self.shared is None:
                self.sessions.touch(req.session_id, owner=owner)  # the session is the asking key's
                # a file written elsewhere by a mount whose closes send nothing: listed, not held
                # (a later open or stat asks, and recalls the writer: daemon/callbacks.py)
                listed = [(e.attr.ino, req.ino, e.name) for e in entries if stat.S_ISREG(e.attr.mode)
                          and not self.callbacks.written_elsewhere(req.session_id, e.attr.ino)]
                callback = self.callbacks.grant_many(req.session_id, listed)
                if req.after == 0 and not more:  # every name of the directory in one reply
                    whole = self.callbacks.grant_dir(req.session_id, req.ino)
            return entries, more, files, callback, whole

        owner = current_peer()
        # several daemons: a listing that may hold the directory writes its row in the same
        # SERIALIZABLE transaction, as of a position read before it (daemon/shared_holds.py)
        shared = bool(req.callback and req.session_id and self.shared is not None)
        if shared:
            self.sessions.touch(req.session_id, owner=owner)  # the session is the asking key's
            shared = self.callbacks.may_hold_dir(req.session_id)
        if not shared:
            entries, more, files, callback, whole = await self.txn.read(list_dir)
        else:
            as_of = self._feed_seq()
            entries, more, files, callback, grant = await self.txn.run(list_dir, readonly=False)
            whole = self.shared.granted(req.ino, req.session_id, grant, as_of) if grant > 0 else -1
        return P.ReaddirRsp(entries=entries, more=more, files=files, callback=callback, dir_callback=whole)

    async def handle_statfs(self, req: P.StatfsReq) -> P.Msg:
        total, free, used, files = await self.txn.read(self.ns.statfs)
        return P.StatfsRsp(total_bytes=total, free_bytes=free, files=files, used_bytes=used)

    # -- xattrs and layouts ------------------------------------------------------

    async def handle_setxattr(self, req: P.SetxattrReq) -> P.Msg:
        await self.txn.write(self.ns.setxattr, req.ino, req.name, req.value, req.flags)
        return P.OkRsp()

    async def handle_getxattr(self, req: P.GetxattrReq) -> P.Msg:
        return P.XattrRsp(value=await self.txn.read(self.ns.getxattr, req.ino, req.name))

    async def handle_listxattr(self, req: P.ListxattrReq) -> P.Msg:
        return P.ListxattrRsp(names=await self.txn.read(self.ns.listxattr, req.ino))

    async def handle_removexattr(self, req: P.RemovexattrReq) -> P.Msg:
        await self.txn.write(self.ns.removexattr, req.ino, req.name)
        return P.OkRsp()

    async def handle_get_layout(self, req: P.GetLayoutReq) -> P.Msg:
        return P.LayoutRsp(layout=await self.txn.read(self.ns.get_layout, req.ino))

    async def handle_set_layout(self, req: P.SetLayoutReq) -> P.Msg:
        layout = await self.txn.write(self.ns.set_layout, req.ino, req.chunk_size, req.stripe_count, req.redundancy)
        return P.LayoutRsp(layout=layout)

    # -- data path bookkeeping ---------------------------------------------------

    async def handle_delegate_inodes(self, req: P.DelegateInodesReq) -> P.Msg:
        self.sessions.touch(req.session_id, owner=current_peer())  # the session is the asking key's
        first = await self.txn.write(self.inode_ranges.delegate, req.session_id, req.count)
        return P.InodesRsp(first=first, count=req.count)

    async def handle_alloc_epoch(self, req: P.AllocEpochReq) -> P.Msg:
        return await self._perform(self._op_alloc_epoch(req))

    def _op_alloc_epoch(self, req: P.AllocEpochReq) -> Op:
        pair = bool(req.pair and self.ns.epoch_pairs)
        return Op(functools.partial(self._epoch, pair), True, None, None, lambda epoch, _, __: P.EpochRsp(epoch=epoch, pair=pair))

    async def handle_alloc_chunks(self, req: P.AllocChunksReq) -> P.Msg:
        return await self._perform(self._op_alloc_chunks(req))

    def _op_alloc_chunks(self, req: P.AllocChunksReq) -> Op:
        return Op(functools.partial(self.ns.alloc_chunks, req.ino, req.indices), True, None, None,
                  lambda placed, _, __: P.ChunksRsp(chunks=placed[0], nodes=placed[1]))

    async def handle_release_chunks(self, req: P.ReleaseChunksReq) -> P.Msg:
        return await self._perform(self._op_release_chunks(req))

    def _op_release_chunks(self, req: P.ReleaseChunksReq) -> Op:
        return Op(functools.partial(self.ns.release_chunks, req.ino, req.indices), True, None, None, lambda *_: P.OkRsp())

    async def handle_replace_replica(self, req: P.ReplaceReplicaReq) -> P.Msg:
        chunk, nodes = await self.txn.write(self.ns.replace_replica, req.ino, req.index, req.failed_node, req.part)
        return P.ChunksRsp(chunks=[chunk], nodes=nodes)

    async def handle_commit(self, req: P.CommitReq) -> P.Msg:
        return await self.snapshot_service.gated(lambda: self._perform(self._op_commit(req)))

    def _op_commit(self, req: P.CommitReq) -> Op:
        self.sessions.check_fence(req.ino, req.chunks)
        fn = functools.partial(self.ns.commit, req.ino, req.size, req.mtime_ns, req.chunks)
        # the reply carries its seq: the writer keeps its callback on the file through its own commit
        # and the reply's attributes answer its next stat (daemon/callbacks.py, client/operations.py)
        return Op(fn, True, lambda: None, ([req.ino], []), lambda attr, _, seq: P.AttrRsp(attr=attr, seq=seq))

    # -- online conversion (daemon/redundancy.py) ----------------------------------

    async def handle_create_shadow(self, req: P.CreateShadowReq) -> P.Msg:
        owner = current_peer()
        self.sessions.touch(req.session_id, owner=owner)

        def create_and_hold():
            shadow = self.ns.create_shadow(req.ino, req.redundancy)
            self.sessions.open(req.session_id, shadow, owner=owner)  # under the lock: nothing reclaims it in between
            return self.ns.open_info(shadow)

        attr, layout, chunks, nodes = await self.txn.write(create_and_hold)
        epoch = await self.txn.alloc_epoch(self.ns.alloc_epoch)
        return P.OpenRsp(attr=attr, layout=layout, chunks=chunks, nodes=nodes, epoch=epoch)

    async def handle_swap_shadow(self, req: P.SwapShadowReq) -> P.Msg:
        def change(result):
            _, entries = result
            return [req.ino, *{parent for parent, _ in entries}], entries

        attr, entries = await self.txn.write(
            self.ns.swap_shadow, req.ino, req.shadow, req.size, req.mtime_ns, req.chunks, change=change
        )
        self._wake_gc()
        return P.AttrRsp(attr=attr)


def _nothing() -> None:
    """The operation of a recall (``MetaService._recall``): only its change is logged."""
