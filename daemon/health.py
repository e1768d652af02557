"""Who is alive: storage nodes (their states) and client sessions (open files).

Storage nodes
-------------
A node registers (RegisterNodeReq) at start and whenever the daemon answers
its heartbeat with NOT_FOUND (the daemon restarted and does not know it yet).
Registration is stored in the ``nodes`` table so that chunk maps can name the
node's address while it is down. At daemon start every known node is down
until it heartbeats: the daemon never places data on a node it has not heard
from in this boot.

A node is in exactly one of five states (``NodeRegistry.state``)::

    up        heartbeating; takes new chunks; a repair source and target
    suspect   silent for node_suspect_s: still a source and still placed on
              (a slow beat is not a failure), logged so an operator sees it coming
    down      silent for node_timeout_s: gets nothing new; every chunk it held
              is re-replicated elsewhere (daemon/repair.py); its next heartbeat
              brings it back, its obsolete copies then go as garbage
    draining  an operator asked to empty it (``stripefs node drain``): it keeps
              serving reads and is a repair source, but gets no new chunks and
              every copy on it is moved away (copy, switch, then delete)
    removed   forgotten by an operator (``stripefs node remove``); final for
              that node id (ids are never reused); its heartbeats are ignored

A node takes new chunks only once it has *answered*: a daemon with CURVE on
pings the address a node registers before recording it, and a node whose
ping failed is placed on from its next heartbeat only (``proven``), so ids
registered for nodes that never answer get no data. (Without CURVE a
registration is trusted as before.)

up/suspect/down follow heartbeats; draining and removed are the
*administrative* state, persisted in the ``meta`` table (key
``node_admin.<id>``) so that they survive a daemon restart, and they win over
the heartbeat state except that a draining node that stops beating is down.
Every change of a node's state is logged (WARNING for suspect and down, INFO
otherwise) and ``on_change`` is called so that repair rescans at once.

Sessions
--------
A mount says HelloReq and gets a session id: 63 random bits (within the
int64 that stores keep), so no key can guess another's, and ids of two boots
or two daemons do not collide. A session belongs to the key that opened it
(``owner``, the CURVE key; None on a plain socket): a request naming a
session of another key is refused ACCESS, so no key can renew, empty or
close another's open set. Its SessionHeartbeatReq carries the full set of
inodes it has open and replaces the previous one. A session silent for
``session_lease_s`` expires (INFO) and its open set is dropped. Sessions live
in memory only: after a restart the daemon answers a heartbeat NOT_FOUND and
mounts say hello again (an open naming an unknown session adopts it for the
key that sends it). ``is_open(ino)`` is what
keeps an unlinked inode (an orphan) alive; every method that can drop the
last reference to an inode returns those inodes so the caller can reclaim
orphans among them.

Bounds (review, issue 20: 20 adopted sessions holding 150,000 inodes each
grew a daemon by 170 MiB): a session holds at most ``max_open`` inodes (an
open or heartbeat past it is refused LIMIT, EMFILE at the mount; a lookup
then answers without open information) and a key has at most ``max_per_key``
sessions (a hello or an adoption past it is refused LIMIT). Each refusal is
logged once per session or key per minute.

Both classes take ``now`` (monotonic seconds) as an argument so tests can
drive time by hand.
"""

from __future__ import annotations

import collections
import functools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..common import protocol
from ..common.errors import ErrorCode, StripefsError
from ..common.security import KEY_MARK
from ..common.space import shared_capacity
from .placement import NodeView
from .store import SqliteStore

log = logging.getLogger(__name__)


NODE_STATES = ("up", "suspect", "down", "draining", "removed")
#: states whose copies count as live (readable) and that may serve as repair sources
LIVE_STATES = frozenset({"up", "suspect", "draining"})
#: states that may receive new chunks and repair copies
PLACEABLE_STATES = frozenset({"up", "suspect"})
_ADMIN_KEY = "node_admin.{}"


@dataclass
class _Node:
    node_id: int
    address: str
    host: str
    capacity: int = 0
    free: int = 0
    used: int = 0
    chunks: int = 0
    filesystem: str = ""  # which file system capacity and free are of (common/space.py); "" unknown
    last_heartbeat: float = float("-inf")  # monotonic seconds
    up: bool = False  # heard from within node_timeout_s (up or suspect)
    admin: str = ""  # "" | "draining" | "removed"
    state: str = "down"  # the last state logged
    proven: bool = False  # it answered (a ping at its registered address, or a heartbeat): it may take chunks


class NodeRegistry:
    """Storage nodes known to this daemon, in memory, registrations persisted in the store."""

    def __init__(self, store: SqliteStore, node_timeout_s: float, node_suspect_s: float | None = None):
        self._store = store
        self._timeout = node_timeout_s
        self._suspect = min(node_suspect_s, node_timeout_s) if node_suspect_s is not None else node_timeout_s
        self._nodes: dict[int, _Node] = {}
        self.registering = threading.Lock()  # held by a registration and the check of its key's rights
        self.on_change: Callable[[int, str, str], None] = lambda node_id, old, new: None
        for row in store.all_nodes():
            node = self._nodes[row["node_id"]] = _Node(
                row["node_id"], row["address"], row["host"], row["capacity"], row["free"], row["used"], row["chunks"]
            )
            node.admin = store.get_meta(_ADMIN_KEY.format(node.node_id), "") or ""
            node.state = self._state_of(node, time.monotonic())
        if self._nodes:
            log.info("%d known storage node(s), all down until they heartbeat: %s", len(self._nodes), sorted(self._nodes))

    # -- states ----------------------------------------------------------------

    def _state_of(self, node: _Node, now: float) -> str:
        if node.admin == "removed":
            return "removed"
        if not node.up:
            return "down"
        if node.admin == "draining":
            return "draining"
        if now - node.last_heartbeat > self._suspect:
            return "suspect"
        return "up"

    def _update(self, node: _Node, now: float, why: str = "") -> None:
        """Recompute ``node``'s state; log and announce a change."""
        new = self._state_of(node, now)
        old = node.state
        if new == old:
            return
        node.state = new
        level = logging.WARNING if new in ("suspect", "down") else logging.INFO
        log.log(level, "node %d (%s): %s -> %s%s", node.node_id, node.address, old, new, f" ({why})" if why else "")
        self.on_change(node.node_id, old, new)

    def _current(self, node: _Node) -> str:
        """``node.state``, unless ``up`` was changed without a sweep (tests flip it): then as of its last beat."""
        if node.state == "removed" or (node.state == "down") == (not node.up):
            return node.state
        return self._state_of(node, node.last_heartbeat if node.up else float("inf"))

    def state(self, node_id: int) -> str:
        node = self._nodes.get(node_id)
        return self._current(node) if node is not None else "removed"

    def states(self) -> dict[int, str]:
        return {n.node_id: self._current(n) for n in self._nodes.values()}

    def set_admin(self, node_id: int, admin: str, now: float | None = None) -> None:
        """Drain, undrain ("") or remove a node; persisted (call inside a write)."""
        now = time.monotonic() if now is None else now
        node = self._nodes.get(node_id)
        if node is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"storage node {node_id} is not known to this cluster")
        if node.admin == "removed" and admin != "removed":
            raise StripefsError(ErrorCode.INVALID, f"storage node {node_id} was removed; node ids are never reused")
        node.admin = admin
        self._store.set_meta(_ADMIN_KEY.format(node_id), admin)
        self._update(node, now, f"operator: {admin or 'undrain'}")

    # -- heartbeats ------------------------------------------------------------

    def register(self, req: protocol.RegisterNodeReq, now: float | None = None, *, proven: bool = True) -> None:
        """``proven``: the node answered at ``req.address`` (else it takes no chunks until it heartbeats)."""
        now = time.monotonic() if now is None else now
        _check_report(req)
        node = self._nodes.get(req.node_id)
        if node is None:
            node = _Node(req.node_id, req.address, req.host)
            # copy on write: with PostgreSQL, placement reads the registry from worker threads meanwhile
            self._nodes = {**self._nodes, req.node_id: node}
            log.info("node %d registered: %s, host %s", req.node_id, req.address, req.host)
        elif node.address != req.address or node.host != req.host:
            log.info("node %d moved: %s, host %s", req.node_id, req.address, req.host)
        node.address, node.host = req.address, req.host
        node.proven = proven
        _heard_from(node, req, now)
        self._store.upsert_node(
            req.node_id, req.address, req.host, req.capacity_bytes, req.free_bytes, req.used_bytes, req.chunks, time.time_ns()
        )
        self._update(node, now, "registered")

    def heartbeat(self, req: protocol.NodeHeartbeatReq, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        _check_report(req)
        node = self._nodes.get(req.node_id)
        if node is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"node {req.node_id} is not registered; register again")
        if not node.proven:
            log.info("node %d (%s) heartbeats: it takes chunks from now on", node.node_id, node.address)
        node.proven = True
        _heard_from(node, req, now)
        self._update(node, now, "heartbeat")

    def sweep(self, now: float | None = None) -> list[int]:
        """Move silent nodes to suspect and down; the ids that just went down."""
        now = time.monotonic() if now is None else now
        went_down = []
        for node in self._nodes.values():
            silence = now - node.last_heartbeat
            if node.up and silence > self._timeout:
                node.up = False
                went_down.append(node.node_id)
            self._update(node, now, f"no heartbeat for {silence:.1f}s" if silence != float("inf") else "")
        return went_down

    # -- queries ---------------------------------------------------------------

    def is_up(self, node_id: int) -> bool:
        """Alive and not removed: it answers requests (garbage collection, repair sources)."""
        node = self._nodes.get(node_id)
        return node is not None and self._current(node) in LIVE_STATES

    def address(self, node_id: int) -> str:
        node = self._nodes.get(node_id)
        return node.address if node else ""

    def up_ids(self) -> list[int]:
        return [n.node_id for n in self._nodes.values() if self._current(n) in LIVE_STATES]

    def _placeable(self, node: _Node) -> bool:
        return node.proven and self._current(node) in PLACEABLE_STATES

    def views(self) -> list[NodeView]:
        """Every node, for placement (which uses only the ones that may take new chunks)."""
        return [NodeView(n.node_id, n.host, n.free, self._placeable(n)) for n in self._nodes.values()]

    def usage(self) -> dict[int, tuple[int, int]]:
        """node id -> (used bytes, capacity bytes) of nodes that may take chunks (rebalance)."""
        return {n.node_id: (n.used, n.capacity) for n in self._nodes.values() if self._placeable(n)}

    def capacity(self) -> tuple[int, int, int]:
        """(total, free, used) bytes over the nodes that may take new chunks: total and free count a
        file system shared by several nodes once (common/space.py), used is what stripefs stores there."""
        up = [n for n in self._nodes.values() if self._placeable(n)]
        total, free = shared_capacity((n.filesystem, n.capacity, n.free) for n in up)
        return total, free, sum(n.used for n in up)

    def held_by(self, key: str) -> list[int]:
        """The ids of nodes registered with ``key`` in their address, not removed."""
        held = []
        for n in self._nodes.values():
            _, mark, node_key = n.address.partition(KEY_MARK)
            if mark and node_key == key and n.admin != "removed":
                held.append(n.node_id)
        return held

    def info(self, now: float | None = None, placed: dict[int, int] | None = None) -> list[protocol.NodeInfo]:
        now = time.monotonic() if now is None else now
        placed = placed if placed is not None else {}
        return [
            protocol.NodeInfo(
                node_id=n.node_id,
                address=n.address,
                host=n.host,
                state=self._current(n),
                capacity_bytes=n.capacity,
                free_bytes=n.free,
                used_bytes=n.used,
                filesystem=n.filesystem,
                chunks=n.chunks,
                last_heartbeat_age_s=max(0.0, now - n.last_heartbeat) if n.last_heartbeat > float("-inf") else -1.0,
                placed_chunks=placed.get(n.node_id, 0 if placed else -1),
            )
            for n in sorted(self._nodes.values(), key=lambda n: n.node_id)
        ]


    # -- several daemons ---------------------------------------------------------

    def admin_states(self) -> dict[int, str]:
        """The administrative state of every known node as stored (run in a read transaction)."""
        return {node_id: self._store.get_meta(_ADMIN_KEY.format(node_id), "") or "" for node_id in list(self._nodes)}

    def apply_admin_states(self, admins: dict[int, str], now: float | None = None) -> None:
        """Adopt drains, undrains and removals an operator made through another daemon."""
        now = time.monotonic() if now is None else now
        for node_id, admin in admins.items():
            node = self._nodes.get(node_id)
            if node is not None and node.admin != admin and node.admin != "removed":
                node.admin = admin
                self._update(node, now, f"operator, through another daemon: {admin or 'undrain'}")


@dataclass
class _Session:
    session_id: int
    host: str
    pid: int
    mountpoint: str
    last_seen: float
    open: set[int] = field(default_factory=set)
    writing: set[int] = field(default_factory=set)  # of ``open``: opened (or created) for writing
    owner: str | None = None  # the key that opened (or adopted) it; None: a plain socket
    warned: float = float("-inf")  # when a refusal past max_open was last logged


def _locked(method):
    """With PostgreSQL, requests run in worker threads: session changes take the table's lock."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._mutex:
            return method(self, *args, **kwargs)

    return call


class Sessions:
    """Mounts and the inodes they hold open, with an open count per inode."""

    def __init__(self, lease_s: float, max_open: int = 262_144, max_per_key: int = 256):
        self._mutex = threading.RLock()
        self.lease_s = lease_s
        self.max_open = max(1, max_open)  # inodes one session holds
        self.max_per_key = max(1, max_per_key)  # sessions of one key (None: every plain-socket peer)
        self._sessions: dict[int, _Session] = {}
        self._open_count: collections.Counter[int] = collections.Counter()
        self._per_key: collections.Counter[str | None] = collections.Counter()
        self._key_warned: dict[str | None, float] = {}  # when a refusal of the key's sessions was last logged
        self._fences: dict[int, int] = {}  # ino -> epochs at or below are no longer committable (lease expired)

    def __len__(self) -> int:
        return len(self._sessions)

    @_locked
    def hello(self, host: str, pid: int, mountpoint: str, now: float | None = None, owner: str | None = None) -> int:
        now = time.monotonic() if now is None else now
        self._admit(owner, now)
        sid = 0
        while not sid or sid in self._sessions:
            sid = secrets.randbelow(protocol.INT64_MAX) + 1  # unguessable, within the stores' int64
        self._sessions[sid] = _Session(sid, host, pid, mountpoint, now, owner=owner)
        self._per_key[owner] += 1
        log.info("session %d opened by %s pid %d (%s)", sid, host, pid, mountpoint or "no mountpoint")
        return sid

    def _admit(self, owner: str | None, now: float) -> None:
        """Refuse a new session of ``owner`` when it has ``max_per_key`` already."""
        count = self._per_key[owner]
        if count < self.max_per_key:
            return
        if now - self._key_warned.get(owner, float("-inf")) >= 60.0:
            if len(self._key_warned) > 10_000:
                self._key_warned.clear()
            self._key_warned[owner] = now
            log.warning("key %s has %d sessions, max_sessions_per_key: new ones are refused (logged once a minute)", owner or "(none)", count)
        raise StripefsError(ErrorCode.LIMIT, f"this key has {count} sessions, the daemon's max_sessions_per_key: close a mount or let its session expire")

    def _get(self, session_id: int, now: float | None, *, adopt: bool = False, owner: str | None = None) -> _Session:
        """The session of key ``owner``, lease renewed. ``adopt``: a session this daemon does not
        know (it restarted, or the mount failed over from another daemon) is taken back under its
        old id, for the key naming it, rather than failing the request: sessions are soft state
        that mounts rebuild, and an open() must not fail for it. Ids are random, so the key naming
        an id this daemon does not know is the key it was handed to."""
        now = time.monotonic() if now is None else now
        session = self._sessions.get(session_id)
        if session is None:
            if not 0 < session_id <= protocol.INT64_MAX:  # never handed out: nothing to adopt
                raise StripefsError(ErrorCode.NOT_FOUND, f"session {session_id} is not a session id; say hello again")
            if not adopt:
                raise StripefsError(ErrorCode.NOT_FOUND, f"session {session_id} is unknown or expired; say hello again")
            self._admit(owner, now)
            session = self._sessions[session_id] = _Session(session_id, "?", 0, "", now, owner=owner)
            self._per_key[owner] += 1
            log.info("session %d adopted (opened before this daemon started)", session_id)
        elif session.owner != owner:
            log.warning("session %d (%s pid %d) named by key %s, not the key that opened it: refused",
                        session_id, session.host, session.pid, owner)
            raise StripefsError(ErrorCode.ACCESS, f"session {session_id} belongs to another key")
        session.last_seen = now
        return session

    def _set_open(self, session: _Session, inos: set[int]) -> list[int]:
        """Replace the open set; the inodes nobody has open any more."""
        for ino in inos - session.open:
            self._open_count[ino] += 1
        released = []
        for ino in session.open - inos:
            self._open_count[ino] -= 1
            if self._open_count[ino] <= 0:
                del self._open_count[ino]
                released.append(ino)
        session.open = inos
        session.writing &= inos
        return released

    def _full(self, session: _Session, count: int, now: float | None) -> StripefsError:
        """The refusal of ``count`` open inodes for ``session``; logged once a minute per session."""
        now = time.monotonic() if now is None else now
        if now - session.warned >= 60.0:
            session.warned = now
            log.warning("session %d (%s pid %d, key %s) would hold %d open inodes, more than max_open_per_session (%d): refused",
                        session.session_id, session.host, session.pid, session.owner or "(none)", count, self.max_open)
        return StripefsError(ErrorCode.LIMIT, f"the session would hold {count} open inodes; the daemon's max_open_per_session is {self.max_open}")

    @_locked
    def heartbeat(self, session_id: int, open_inodes: list[int], now: float | None = None, owner: str | None = None) -> list[int]:
        session = self._get(session_id, now, owner=owner)  # renewed even when refused: it keeps what it held
        inos = set(open_inodes)
        if len(inos) > self.max_open:
            raise self._full(session, len(inos), now)
        return self._set_open(session, inos)

    @_locked
    def touch(self, session_id: int, now: float | None = None, owner: str | None = None) -> None:
        """Renew the session's lease (adopting it if this daemon restarted since it began)."""
        self._get(session_id, now, adopt=True, owner=owner)

    @_locked
    def open(self, session_id: int, ino: int, now: float | None = None, owner: str | None = None, *, write: bool = False) -> None:
        """``write``: opened for writing (OpenReq.write, a create): ``writing_inodes`` until the session
        lets it go (a heartbeat without it, or a close)."""
        session = self._get(session_id, now, adopt=True, owner=owner)
        if ino not in session.open:
            if len(session.open) >= self.max_open:
                raise self._full(session, len(session.open) + 1, now)
            session.open.add(ino)
            self._open_count[ino] += 1
        if write:
            session.writing.add(ino)

    @_locked
    def close(self, session_id: int, ino: int, now: float | None = None, owner: str | None = None) -> list[int]:
        session = self._get(session_id, now, owner=owner)
        if ino not in session.open:
            return []
        session.writing.discard(ino)
        session.open.discard(ino)  # in place: a copy of a large open set per close would cost milliseconds
        self._open_count[ino] -= 1
        if self._open_count[ino] > 0:
            return []
        del self._open_count[ino]
        return [ino]

    @_locked
    def holding(self, session_id: int) -> frozenset[int]:
        """The inodes the session holds now (none when unknown)."""
        session = self._sessions.get(session_id)
        return frozenset(session.open) if session is not None else frozenset()

    @_locked
    def fence(self, ino: int, epoch: int) -> None:
        """Chunks of ``ino`` written at or below ``epoch`` belong to a session whose lease expired and
        whose uncommitted copies were reclaimed (daemon/repair.py ``reclaim_uncommitted``): a commit of
        them (a mount that was only paused past its lease, not dead) is refused with STALE, as a lost
        lease should be, instead of recording copies that are being deleted. Fences live in memory: a
        daemon restart forgets them (and every session with them)."""
        self._fences[ino] = epoch

    @_locked
    def check_fence(self, ino: int, chunks) -> None:
        """Refuse a commit of chunk versions written under a lease that expired (``fence``)."""
        fence = self._fences.get(ino)
        if fence is None:
            return
        old = [c.index for c in chunks if 0 < c.version <= fence]
        if old:
            raise StripefsError(
                ErrorCode.STALE,
                f"inode {ino}: chunk(s) {old[:5]} were written under a session lease that expired; their copies are gone",
            )

    @_locked
    def expire(self, now: float | None = None) -> list[int]:
        """Drop sessions silent for longer than the lease; the inodes nobody has open any more."""
        now = time.monotonic() if now is None else now
        released: list[int] = []
        for sid, session in list(self._sessions.items()):
            if now - session.last_seen > self.lease_s:
                log.info(
                    "session %d (%s pid %d) expired after %.1fs of silence; releasing %d open inode(s)",
                    sid, session.host, session.pid, now - session.last_seen, len(session.open),
                )
                released += self._drop(session)
        return released

    @_locked
    def end(self, session_id: int, owner: str | None = None) -> list[int]:
        """The mount unmounted (``SessionEndReq``): its session goes now, as at its lease's end; the
        inodes nobody has open any more. A session this daemon does not know ends nothing."""
        session = self._sessions.get(session_id)
        if session is None:
            return []
        self._get(session_id, None, owner=owner)  # another key's session: ACCESS
        log.info("session %d (%s pid %d) ended by its mount; releasing %d open inode(s)",
                 session_id, session.host, session.pid, len(session.open))
        return self._drop(session)

    def _drop(self, session: _Session) -> list[int]:
        released = self._set_open(session, set())
        del self._sessions[session.session_id]
        self._per_key[session.owner] -= 1
        if self._per_key[session.owner] <= 0:
            del self._per_key[session.owner]
        return released

    def is_open(self, ino: int) -> bool:
        return self._open_count.get(ino, 0) > 0

    def alive(self, session_id: int) -> bool:
        """The session is open here (not closed, not expired)."""
        return session_id in self._sessions

    def owner_of(self, session_id: int) -> str | None:
        """The key that opened (or adopted) the session; None on a plain socket or when unknown."""
        session = self._sessions.get(session_id)
        return session.owner if session is not None else None

    @_locked
    def open_inodes(self) -> set[int]:
        """Every inode some session holds open."""
        return set(self._open_count)

    @_locked
    def writing_inodes(self) -> set[int]:
        """Every inode some session opened for writing and still holds (rebalance waits for them,
        daemon/repair.py "Open files"). Mounts send no close, so this is until the session heartbeat
        after the file's last release (every third of the session lease)."""
        return set().union(*(s.writing for s in self._sessions.values()))

    @_locked
    def is_writing(self, ino: int) -> bool:
        return any(ino in s.writing for s in self._sessions.values())


def _check_node_id(node_id: int) -> None:
    if node_id < 1:  # 0 marks a missing EC fragment in chunk rows (daemon/redundancy.py)
        raise StripefsError(ErrorCode.INVALID, f"storage node id {node_id} is invalid: ids start at 1")
    if node_id > protocol.INT64_MAX:
        raise StripefsError(ErrorCode.INVALID, f"storage node id {node_id} is larger than {protocol.INT64_MAX}")


def _check_report(req) -> None:
    """A registration's or heartbeat's figures, before anything is kept: they are summed (statfs)
    and stored, so each must be a sane 64-bit count."""
    _check_node_id(req.node_id)
    for field in ("capacity_bytes", "free_bytes", "used_bytes", "chunks"):
        value = getattr(req, field)
        if not 0 <= value <= 1 << 60:  # an exabyte, and room to sum thousands of them
            raise StripefsError(ErrorCode.INVALID, f"node {req.node_id}: {field} {value} is out of range")
    if len(req.filesystem) > 255:
        raise StripefsError(ErrorCode.INVALID, f"node {req.node_id}: file system id of {len(req.filesystem)} characters (at most 255)")
    if isinstance(req, protocol.RegisterNodeReq):
        if not protocol.is_endpoint(req.address):
            raise StripefsError(ErrorCode.INVALID, f"node {req.node_id}: address {req.address[:100]!r} is not tcp://HOST:PORT")
        if len(req.host) > 255:
            raise StripefsError(ErrorCode.INVALID, f"node {req.node_id}: host label of {len(req.host)} characters (at most 255)")


def _heard_from(node, req, now: float) -> None:
    """A registration or heartbeat arrived: its usage figures, and the node is up."""
    node.capacity, node.free, node.used, node.chunks = req.capacity_bytes, req.free_bytes, req.used_bytes, req.chunks
    node.filesystem = req.filesystem
    node.last_heartbeat = now
    node.up = True
